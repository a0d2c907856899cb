package coalesce

import (
	"time"

	"github.com/kpipe/kpipe/bus"
)

// A restarted kubelet reports every pod on its node not ready until that pod's
// next readiness probe (kubernetes#100277): a service whose endpoints all run
// there has none for tens of milliseconds. kube-proxy's sync takes longer
// than that flap and so never programs it; kpipe's takes milliseconds, and
// once it has rejected a service, the min-sync-period would hold the REJECT
// for up to a second after the endpoints came back. So, for each family:
//
//   - a snapshot that takes away a service's last usable endpoint (in the
//     cluster, or on this node) waits until that change is maxSettle old (or
//     the min-sync-period, if shorter): a flap shorter than that is never
//     programmed;
//   - a snapshot that gives back endpoints the last snapshot took away goes
//     without waiting for a token, once per token spent: an outage is never
//     held longer than the API holds it, and syncs stay within twice the
//     rate the min-sync-period allows.
//
// Both decide only when a snapshot goes, never what it holds: render alone
// decides which endpoints each rule uses, so reach below may be coarse.
const maxSettle = 250 * time.Millisecond

// reach says whether a service has endpoints that can take traffic (ready,
// or serving while terminating, the fallback kube-proxy uses): anywhere, and
// on this node (what the Local traffic policies use).
type reach struct{ anywhere, local bool }

// reachOf is key's reach in st for family f; tracked is false when the
// service has no ClusterIP of f (deleted, headless or the other family's):
// there is nothing of it to reject.
func reachOf(st *bus.State, key bus.ServiceKey, f bus.Family) (r reach, tracked bool) {
	svc := st.Services[key]
	if svc == nil {
		return reach{}, false
	}
	if _, ok := svc.ClusterIPOf(f); !ok {
		return reach{}, false
	}
	node := ""
	if st.Node != nil {
		node = st.Node.Name
	}
	for _, sl := range st.Slices[key] {
		if sl.Family != f {
			continue
		}
		for _, e := range sl.Items {
			if e.Ready || e.Serving && e.Terminating {
				r.anywhere = true
				r.local = r.local || node != "" && e.NodeName == node
			}
		}
	}
	return r, true
}

// lost says whether going from was to now takes endpoints away entirely.
func lost(was, now reach) bool { return was.anywhere && !now.anywhere || was.local && !now.local }

// gained says whether going from was to now gives endpoints to a service
// that had none: rejected traffic that now goes through.
func gained(was, now reach) bool { return !was.anywhere && now.anywhere || !was.local && now.local }

// seen is a changed service's reach now; tracked as reachOf says.
type seen struct {
	reach
	tracked bool
}

// outages tracks, for one family, the services whose endpoints the pending
// changes take away or give back, against the last snapshot sent.
type outages struct {
	sent    map[bus.ServiceKey]reach     // each service's reach in the last snapshot that carried it
	changed map[bus.ServiceKey]seen      // services changed since the last snapshot, as they are now
	losing  map[bus.ServiceKey]time.Time // changed services that lose endpoints, since when
	gaining map[bus.ServiceKey]bool      // changed services that gain endpoints
	// bypassed says a snapshot went without a token since the last one that
	// took a token.
	bypassed bool
}

func newOutages() outages {
	return outages{sent: map[bus.ServiceKey]reach{}, changed: map[bus.ServiceKey]seen{}, losing: map[bus.ServiceKey]time.Time{},
		gaining: map[bus.ServiceKey]bool{}}
}

// note records key's reach in st after a change at now.
func (o *outages) note(st *bus.State, key bus.ServiceKey, f bus.Family, now time.Time) {
	r, tracked := reachOf(st, key, f)
	o.changed[key] = seen{r, tracked}
	was, known := o.sent[key]
	compared := tracked && known // a new or gone service neither loses nor gains
	switch {
	case !compared || !lost(was, r):
		delete(o.losing, key)
	case o.losing[key].IsZero(): // since the first change that lost them
		o.losing[key] = now
	}
	if compared && gained(was, r) {
		o.gaining[key] = true
	} else {
		delete(o.gaining, key)
	}
}

// settledAt is when the oldest loss pending has settled (ok false: none).
func (o *outages) settledAt(settle time.Duration) (at time.Time, ok bool) {
	for _, since := range o.losing {
		if !ok || since.Before(at) {
			at, ok = since, true
		}
	}
	return at.Add(settle), ok
}

// mayBypass says whether the next snapshot may go without a token.
func (o *outages) mayBypass() bool { return len(o.gaining) > 0 && !o.bypassed }

// sentAll records that a snapshot of the current state went out.
func (o *outages) sentAll() {
	for key, s := range o.changed {
		if s.tracked {
			o.sent[key] = s.reach
		} else {
			delete(o.sent, key)
		}
	}
	clear(o.changed)
	clear(o.losing)
	clear(o.gaining)
}
