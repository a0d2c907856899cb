package main

import (
	"errors"

	"github.com/spf13/cobra"
)

// explainCommand is replaced by the explain command under construction (issue 25).
func explainCommand() *cobra.Command {
	return &cobra.Command{Use: "explain", RunE: func(*cobra.Command, []string) error { return errors.New("not built yet") }}
}
