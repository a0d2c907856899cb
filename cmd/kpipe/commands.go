package main

import "github.com/spf13/cobra"

// operatorCommands are kpipe's commands for operators beside the daemon (the
// root command): each reads, none writes the node's rules.
func operatorCommands() []*cobra.Command {
	return []*cobra.Command{explainCommand(), renderCommand(), statusCommand()}
}
