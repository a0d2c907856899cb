package main

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/render/tracer"
)

// explanation is what `kpipe explain` prints (as text, or as JSON with --json).
type explanation struct {
	Packet  explainedPacket `json:"packet"`
	Note    string          `json:"note,omitempty"`
	Verdict string          `json:"verdict"` // ACCEPT, DROP, REJECT; "ACCEPT|DROP" when paths differ
	// Services are the Services and ports the matched rules name (their
	// comments' first word, "namespace/name:port").
	Services []string `json:"services"`
	// Objects are the apiserver's word on those Services (with --kubeconfig).
	Objects   []serviceFacts      `json:"objects,omitempty"`
	Endpoints []explainedEndpoint `json:"endpoints"`
	Paths     []explainedPath     `json:"paths"`
}

type explainedPacket struct {
	Family      string `json:"family"`
	Proto       string `json:"proto"`
	Source      string `json:"src"`
	Destination string `json:"dst"`
	From        string `json:"from"`
	InInterface string `json:"inInterface,omitempty"`
}

type explainedEndpoint struct {
	Endpoint    string  `json:"endpoint"`
	Probability float64 `json:"probability"`
	// Masqueraded is "yes", "no" or "some paths".
	Masqueraded string `json:"masqueraded"`
}

type explainedPath struct {
	Probability float64 `json:"probability"`
	Endpoint    string  `json:"endpoint,omitempty"` // where DNAT sent it, "" when not DNATed
	Masqueraded bool    `json:"masqueraded"`
	Verdict     string  `json:"verdict"`
	// Delivered is where an accepted packet goes: "this node" (filter
	// INPUT) or "routed on" (FORWARD, or out from the node).
	Delivered string        `json:"delivered,omitempty"`
	Steps     []tracer.Step `json:"steps"`
	// Unevaluated are other agents' rules this path passed without knowing
	// whether they match: taken as not matching.
	Unevaluated []string `json:"unevaluated,omitempty"`
}

func newExplanation(fl explainFlags, p tracer.Packet, note string, res tracer.Result) explanation {
	e := explanation{
		Packet: explainedPacket{Family: bus.FamilyOf(p.Dest).String(), Proto: p.Proto, Source: p.Source.String(),
			Destination: netip.AddrPortFrom(p.Dest, uint16(p.DPort)).String(), From: fl.from, InInterface: p.InInterface},
		Note: note, Verdict: res.Verdict, Services: []string{}, Endpoints: []explainedEndpoint{},
	}
	byEndpoint := map[netip.AddrPort]*explainedEndpoint{}
	for _, path := range res.Paths {
		ep := explainedPath{Probability: path.Probability, Masqueraded: path.Masqueraded, Verdict: path.Verdict,
			Steps: path.Steps, Unevaluated: path.Unevaluated, Delivered: delivered(path)}
		for _, s := range path.Steps {
			if svc := serviceOf(s.Comment); svc != "" && !slices.Contains(e.Services, svc) {
				e.Services = append(e.Services, svc)
			}
		}
		if path.Endpoint.IsValid() && path.Verdict == tracer.Accept {
			ep.Endpoint = path.Endpoint.String()
			masq := yesNo(path.Masqueraded)
			if seen := byEndpoint[path.Endpoint]; seen != nil {
				seen.Probability += path.Probability
				if seen.Masqueraded != masq {
					seen.Masqueraded = "some paths"
				}
			} else {
				byEndpoint[path.Endpoint] = &explainedEndpoint{Endpoint: ep.Endpoint, Probability: path.Probability, Masqueraded: masq}
			}
		}
		e.Paths = append(e.Paths, ep)
	}
	for _, ap := range res.Endpoints {
		if ep := byEndpoint[ap]; ep != nil {
			e.Endpoints = append(e.Endpoints, *ep)
		}
	}
	return e
}

// delivered says where an accepted path's packet goes: to this node when it
// met filter INPUT, else routed on.
func delivered(p tracer.Path) string {
	switch {
	case p.Verdict != tracer.Accept:
		return ""
	case slices.ContainsFunc(p.Steps, func(s tracer.Step) bool { return s.Table == "filter" && s.Chain == "INPUT" && s.Rule == "" }):
		return "this node"
	}
	return "routed on"
}

// serviceOf reads the Service and port a kpipe or kube-proxy rule comment
// names ("default/web:http cluster IP"); "" for any other comment.
func serviceOf(comment string) string {
	first, _, _ := strings.Cut(comment, " ")
	if ns, name, ok := strings.Cut(first, "/"); ok && ns != "" && name != "" {
		return first
	}
	return ""
}

var fromText = map[string]string{fromPod: "from a pod", fromNode: "from a process on this node", fromOutside: "from outside"}

// text is the explanation as an operator reads it.
func (e explanation) text() string {
	var b strings.Builder
	p := e.Packet
	fmt.Fprintf(&b, "packet:   %s %s -> %s %s (%s", p.Proto, p.Source, p.Destination, fromText[p.From], p.Family)
	if p.InInterface != "" {
		fmt.Fprintf(&b, ", in on %s", p.InInterface)
	}
	b.WriteString(")\n")
	if e.Note != "" {
		fmt.Fprintf(&b, "          (%s)\n", e.Note)
	}
	if len(e.Services) > 0 {
		fmt.Fprintf(&b, "service:  %s\n", strings.Join(e.Services, ", "))
		for _, o := range e.Objects {
			fmt.Fprintf(&b, "          %s\n", o)
		}
	} else {
		b.WriteString("service:  none: no Service rule matched this packet\n")
	}
	fmt.Fprintf(&b, "outcome:  %s\n", e.outcome())
	for _, ep := range e.Endpoints {
		fmt.Fprintf(&b, "          %-24s %5.1f%%  %s\n", ep.Endpoint, 100*ep.Probability, masqText(ep.Masqueraded))
	}
	width := 0 // of the widest "table/chain", so the rules line up
	for _, path := range e.Paths {
		for _, s := range path.Steps {
			width = max(width, len(s.Table)+1+len(s.Chain))
		}
	}
	var unevaluated []string
	for i, path := range e.Paths {
		fmt.Fprintf(&b, "\npath %d of %d (%.1f%%): %s\n", i+1, len(e.Paths), 100*path.Probability, path.summary())
		steps := path.Steps
		if i > 0 { // the steps every path shares with path 1 are said once
			same := 0
			for same < len(steps) && same < len(e.Paths[0].Steps) && steps[same] == e.Paths[0].Steps[same] {
				same++
			}
			if same > 1 {
				fmt.Fprintf(&b, "  (the first %d steps as path 1's)\n", same)
				steps = steps[same:]
			}
		}
		for _, s := range steps {
			where := s.Table + "/" + s.Chain
			if s.Rule == "" {
				fmt.Fprintf(&b, "  %-*s (%s)\n", width, where, s.Comment)
				continue
			}
			rule := strings.TrimPrefix(s.Rule, "-A "+s.Chain+" ")
			if s.Mark != "" {
				rule += "   (mark now " + s.Mark + ")"
			}
			fmt.Fprintf(&b, "  %-*s %s\n", width, where, rule)
		}
		for _, u := range path.Unevaluated {
			if !slices.Contains(unevaluated, u) {
				unevaluated = append(unevaluated, u)
			}
		}
	}
	if len(unevaluated) > 0 {
		b.WriteString("\nnot evaluated: rules explain cannot read (other agents' matches and targets), taken as not matching:\n")
		for _, u := range unevaluated {
			fmt.Fprintf(&b, "  %s\n", u)
		}
	}
	return b.String()
}

// outcome is one line for every path together.
func (e explanation) outcome() string {
	switch {
	case len(e.Endpoints) == 1:
		return "ACCEPT, DNAT to 1 endpoint:"
	case len(e.Endpoints) > 1 && e.Verdict == tracer.Accept:
		return fmt.Sprintf("ACCEPT, DNAT to one of %d endpoints:", len(e.Endpoints))
	case len(e.Endpoints) > 1:
		return fmt.Sprintf("%s (paths differ), DNAT to one of %d endpoints:", e.Verdict, len(e.Endpoints))
	case e.Verdict == tracer.Accept && len(e.Paths) > 0:
		return "ACCEPT, not DNATed: the packet goes on as it is (" + e.Paths[0].Delivered + ")"
	case len(e.Paths) == 1:
		return e.Paths[0].summary()
	}
	return e.Verdict + " (paths differ: see below)"
}

// summary says what happened on one path: for a drop or reject, by which rule.
func (p explainedPath) summary() string {
	switch {
	case p.Verdict != tracer.Accept && len(p.Steps) > 0:
		last := p.Steps[len(p.Steps)-1]
		why := ""
		if last.Comment != "" {
			why = ": " + last.Comment
		}
		if last.Rule == "" {
			return fmt.Sprintf("%s by %s/%s's policy", p.Verdict, last.Table, last.Chain)
		}
		return fmt.Sprintf("%s by a rule of %s/%s%s", p.Verdict, last.Table, last.Chain, why)
	case p.Endpoint != "":
		return fmt.Sprintf("DNAT to %s, %s, ACCEPT (%s)", p.Endpoint, masqText(yesNo(p.Masqueraded)), p.Delivered)
	}
	return fmt.Sprintf("%s, not DNATed (%s)", p.Verdict, p.Delivered)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func masqText(m string) string {
	switch m {
	case "yes":
		return "masqueraded (the endpoint sees this node's address)"
	case "no":
		return "source kept"
	}
	return "masqueraded on some paths"
}
