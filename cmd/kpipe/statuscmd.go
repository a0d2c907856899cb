package main

import (
	"errors"

	"github.com/spf13/cobra"
)

// statusCommand is replaced by the status command under construction (issue 25).
func statusCommand() *cobra.Command {
	return &cobra.Command{Use: "status", RunE: func(*cobra.Command, []string) error { return errors.New("not built yet") }}
}
