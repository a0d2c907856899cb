package health

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/kpipe/kpipe/bus"
	"github.com/kpipe/kpipe/stages/events"
)

// mergeChecks folds the latest HealthChecks of every family into one answer per
// service with a healthCheckNodePort: the port (the same in every family; the lowest
// family's wins should they differ for a moment) and the largest local endpoint
// count over the families.
func mergeChecks(latest map[bus.Family]bus.HealthChecks) map[bus.ServiceKey]bus.HealthCheck {
	families := make([]bus.Family, 0, len(latest))
	for f := range latest {
		families = append(families, f)
	}
	slices.Sort(families)
	out := map[bus.ServiceKey]bus.HealthCheck{}
	for _, f := range families {
		for key, hc := range latest[f].Services {
			if hc.NodePort == 0 {
				continue
			}
			cur, ok := out[key]
			if !ok {
				out[key] = hc
				continue
			}
			cur.LocalEndpoints = max(cur.LocalEndpoints, hc.LocalEndpoints)
			out[key] = cur
		}
	}
	return out
}

// serviceServers are the healthCheckNodePort servers of one Run, kube-proxy's
// ServiceHealthServer: one HTTP server per service and listen address. Only Run's
// goroutine calls sync and closeAll; handlers read the endpoint counts atomically.
type serviceServers struct {
	h        *Health
	wg       *sync.WaitGroup
	services map[bus.ServiceKey]*serviceServer
	binds    []bind // where every service's server listens
}

// bind is one listen address of a healthCheckNodePort server, without the port.
type bind struct{ network, host string }

func (b bind) String() string {
	if b.host == "" {
		return "*"
	}
	return b.host
}

// bindsOf says where healthCheckNodePort servers listen, from each family's Addrs
// (nil: every address of the family): one ":port" socket, which covers both
// families, when no family limits them; else each listed address, plus the
// wildcard of any family that does not limit them. A family that lists no address
// has no listener.
func bindsOf(latest map[bus.Family]bus.HealthChecks) []bind {
	families := slices.Sorted(maps.Keys(latest))
	if !slices.ContainsFunc(families, func(f bus.Family) bool { return latest[f].Addrs != nil }) {
		return []bind{{"tcp", ""}}
	}
	var out []bind
	add := func(b bind) {
		if !slices.Contains(out, b) {
			out = append(out, b)
		}
	}
	for _, f := range families {
		addrs := latest[f].Addrs
		if addrs == nil {
			if f == bus.IPv6 {
				add(bind{"tcp6", "::"}) // tcp6 sets IPV6_V6ONLY: IPv4 stays as listed
			} else {
				add(bind{"tcp4", "0.0.0.0"})
			}
			continue
		}
		for _, a := range addrs {
			if a.IsValid() {
				add(bind{"tcp", a.Unmap().String()})
			}
		}
	}
	return out
}

type serviceServer struct {
	key       bus.ServiceKey
	port      int32
	endpoints atomic.Int64
	servers   []*http.Server
	listeners []net.Listener
}

func newServiceServers(h *Health, wg *sync.WaitGroup) *serviceServers {
	return &serviceServers{h: h, wg: wg, services: map[bus.ServiceKey]*serviceServer{}}
}

// sync makes the open servers match the latest health checks of every family: it
// closes those of services that went away or moved port (every one when the listen
// addresses changed), opens the new ones and updates the counts of the others in
// place. A port that cannot be bound is logged and tried again on the next sync.
func (s *serviceServers) sync(latest map[bus.Family]bus.HealthChecks) {
	want := mergeChecks(latest)
	if binds := bindsOf(latest); !slices.Equal(binds, s.binds) {
		if len(s.services) > 0 {
			s.h.log.Info("healthcheck addresses changed; reopening", "addrs", fmt.Sprint(binds))
		}
		s.closeAll()
		s.binds = binds
	}
	for key, svc := range s.services {
		if hc, ok := want[key]; !ok || hc.NodePort != svc.port {
			s.h.log.Info("closing healthcheck", "service", key.String(), "port", svc.port)
			svc.close(s.h.log)
			delete(s.services, key)
		}
	}
	for key, hc := range want {
		if svc := s.services[key]; svc != nil {
			svc.endpoints.Store(int64(hc.LocalEndpoints))
			continue
		}
		svc := &serviceServer{key: key, port: hc.NodePort}
		svc.endpoints.Store(int64(hc.LocalEndpoints))
		if err := s.open(svc); err != nil {
			s.h.log.Error("failed to start healthcheck", "node", s.h.cfg.NodeName,
				"service", key.String(), "port", hc.NodePort, "err", err)
			if s.h.recorder != nil {
				events.RecordServiceHealthcheckFailure(s.h.recorder, s.h.cfg.NodeName, key.Namespace, key.Name, hc.NodePort, err)
			}
			continue
		}
		s.h.log.Info("opened healthcheck", "service", key.String(), "port", hc.NodePort)
		s.services[key] = svc
	}
}

// open binds the service's port on every listen address and serves it; on any
// failure it closes what it had opened, so the port is free for the next try.
func (s *serviceServers) open(svc *serviceServer) error {
	handler := s.h.serviceHandler(svc)
	port := strconv.Itoa(int(svc.port))
	for _, b := range s.binds {
		addr := net.JoinHostPort(b.host, port)
		ln, err := net.Listen(b.network, addr)
		if err != nil {
			svc.close(s.h.log)
			return err // names the address, as kube-proxy's event note shows it
		}
		srv := &http.Server{Handler: handler, ReadHeaderTimeout: readHeaderTimeout,
			ErrorLog: slog.NewLogLogger(s.h.log.Handler(), slog.LevelWarn)}
		svc.servers = append(svc.servers, srv)
		svc.listeners = append(svc.listeners, ln)
		s.wg.Go(func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.h.log.Error("healthcheck closed", "service", svc.key.String(), "addr", addr, "err", err)
			}
		})
	}
	return nil
}

// close stops the service's servers and releases its ports before it returns.
func (svc *serviceServer) close(log *slog.Logger) {
	for _, srv := range svc.servers {
		if err := srv.Close(); err != nil {
			log.Error("closing healthcheck server", "service", svc.key.String(), "err", err)
		}
	}
	for _, ln := range svc.listeners {
		_ = ln.Close() // Serve may not have started yet; Close alone would leave it open
	}
	svc.servers, svc.listeners = nil, nil
}

func (s *serviceServers) closeAll() {
	for key, svc := range s.services {
		svc.close(s.h.log)
		delete(s.services, key)
	}
}

// serviceHandler answers any request on a healthCheckNodePort as kube-proxy does:
// 200 when the service has local endpoints and the proxy is healthy, 503 otherwise,
// with kube-proxy's JSON body (byte for byte) and its headers.
func (h *Health) serviceHandler(svc *serviceServer) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		count := svc.endpoints.Load()
		healthy := h.proxyHealth().Healthy
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		w.Header().Set("X-Load-Balancing-Endpoint-Weight", strconv.FormatInt(count, 10))
		if count != 0 && healthy {
			w.WriteHeader(http.StatusOK)
		} else {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		fmt.Fprintf(w, "{\n\t\"service\": {\n\t\t\"namespace\": %q,\n\t\t\"name\": %q\n\t},\n\t\"localEndpoints\": %d,\n\t\"serviceProxyHealthy\": %v\n}",
			svc.key.Namespace, svc.key.Name, count, healthy)
	})
}
