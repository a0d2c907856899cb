package netfilter

import (
	"context"
	"strings"

	"github.com/kpipe/kpipe/bus"
)

// TranslateAndWrite splits RestoreNetlink in its two halves, for benchmarks:
// the translation, and then the write (what the kernel takes).
func TranslateAndWrite(family bus.Family, payload []byte) (write func(ctx context.Context) error, err error) {
	sections, err := translatePayload(family, payload)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) error { return Tool{Family: family}.writeBatches(ctx, sections) }, nil
}

// SetToolRoot makes every iptables tool run chrooted in root, an image's root
// filesystem ("" for the host's tools); see toolRoot.
func SetToolRoot(root string) { toolRoot = root }

// Version is what t's iptables -V prints, e.g. "iptables v1.8.11 (nf_tables)".
func (t Tool) Version(ctx context.Context) (string, error) {
	out, err := t.runTool(ctx, t.binary(""), nil, "-V")
	return strings.TrimSpace(string(out)), err
}
