package main

import (
	"errors"

	"github.com/spf13/cobra"
)

// renderCommand is replaced by the render command under construction (issue 25).
func renderCommand() *cobra.Command {
	return &cobra.Command{Use: "render", RunE: func(*cobra.Command, []string) error { return errors.New("not built yet") }}
}
