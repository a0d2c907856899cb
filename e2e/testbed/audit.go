package testbed

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"time"
)

// auditPolicy has the kube-apiserver record every list of Services and
// EndpointSlices (who made it, when), and nothing else: the lists a proxy
// makes are what a relist storm is made of.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
- level: Metadata
  verbs: ["list"]
  resources:
  - group: ""
    resources: ["services"]
  - group: "discovery.k8s.io"
    resources: ["endpointslices"]
- level: None
`

// auditArgs writes the audit policy and returns the kube-apiserver flags that
// apply it, logging to tb.auditLog.
func (tb *Testbed) auditArgs() ([]string, error) {
	policy := tb.path("audit-policy.yaml")
	if err := os.WriteFile(policy, []byte(auditPolicy), 0o600); err != nil {
		return nil, fmt.Errorf("write audit policy: %w", err)
	}
	return []string{"--audit-policy-file", policy, "--audit-log-path", tb.auditLog()}, nil
}

func (tb *Testbed) auditLog() string { return tb.path("kube-apiserver-audit.log") }

// Lists counts the lists of Services and EndpointSlices the kube-apiserver
// served since since, by user agent and resource ("services",
// "endpointslices"), from its audit log.
func (tb *Testbed) Lists(since time.Time) (map[string]map[string]int, error) {
	f, err := os.Open(tb.auditLog())
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]map[string]int{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var ev struct {
			Verb      string
			UserAgent string
			ObjectRef struct{ Resource string }
			Received  time.Time `json:"requestReceivedTimestamp"`
		}
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("audit log %s: %w", tb.auditLog(), err)
		}
		if ev.Verb != "list" || ev.Received.Before(since) {
			continue
		}
		if out[ev.UserAgent] == nil {
			out[ev.UserAgent] = map[string]int{}
		}
		out[ev.UserAgent][ev.ObjectRef.Resource]++
	}
	return out, sc.Err()
}
