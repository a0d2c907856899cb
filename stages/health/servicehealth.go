package health

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/kpipe/kpipe/bus"
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

// sync makes the open servers match want: it closes those of services that went away
// or moved port, opens the new ones and updates the counts of the others in place.
// A port that cannot be bound is logged and tried again on the next sync.
func (s *serviceServers) sync(want map[bus.ServiceKey]bus.HealthCheck) {
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
			continue
		}
		s.h.log.Info("opened healthcheck", "service", key.String(), "port", hc.NodePort)
		s.services[key] = svc
	}
}

// hosts are the addresses healthCheckNodePort servers listen on: the node's
// addresses, or every address ("") when none are given.
func (s *serviceServers) hosts() []string {
	var addrs []netip.Addr
	if s.h.cfg.NodeAddrs != nil {
		addrs = s.h.cfg.NodeAddrs()
	}
	var hosts []string
	for _, a := range addrs {
		if !a.IsValid() {
			continue
		}
		if host := a.String(); !slices.Contains(hosts, host) {
			hosts = append(hosts, host)
		}
	}
	if len(hosts) == 0 {
		hosts = []string{""}
	}
	return hosts
}

// open binds the service's port on every host and serves it; on any failure it
// closes what it had opened, so the port is free for the next try.
func (s *serviceServers) open(svc *serviceServer) error {
	handler := s.h.serviceHandler(svc)
	port := strconv.Itoa(int(svc.port))
	for _, host := range s.hosts() {
		addr := net.JoinHostPort(host, port)
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			svc.close(s.h.log)
			return fmt.Errorf("listen on %s: %w", addr, err)
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
