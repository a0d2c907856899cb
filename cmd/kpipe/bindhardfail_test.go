package main

import (
	"strings"
	"testing"
)

// TestBindAddressHardFail: kube-proxy's bindAddressHardFail (file) and
// --bind-address-hard-fail (flag, ignored beside a file, as in kube-proxy)
// reach the options the health stage is built from; kubeadm's file leaves it
// off.
func TestBindAddressHardFail(t *testing.T) {
	kubeadm := readKubeadmConfig(t)
	hardFail := writeFile(t, strings.Replace(kubeadm, "bindAddressHardFail: false", "bindAddressHardFail: true", 1))
	for _, c := range []struct {
		name string
		args []string
		want bool
	}{
		{"kubeadm file", []string{"--config=" + kubeadmConfig}, false},
		{"file", []string{"--config=" + hardFail}, true},
		{"flag", []string{"--bind-address-hard-fail"}, true},
		{"flag beside the file", []string{"--config=" + hardFail, "--bind-address-hard-fail=false"}, true},
	} {
		o, code, stderr := resolved(t, append(c.args, "--hostname-override=n")...)
		if code != 0 {
			t.Fatalf("%s: exit %d: %s", c.name, code, stderr)
		}
		if o.BindAddressHardFail != c.want {
			t.Errorf("%s: BindAddressHardFail = %v, want %v", c.name, o.BindAddressHardFail, c.want)
		}
	}
}
