package netfilter

import (
	"context"

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
