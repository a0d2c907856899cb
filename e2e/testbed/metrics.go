package testbed

import (
	"bufio"
	"fmt"
	"strconv"
	"strings"
)

// ScrapeMetrics GETs the Prometheus text exposition at url from namespace ns
// (kpipe's or kube-proxy's /metrics): each sample's value, keyed by its name
// with its labels as exposed (`name{label="v"}`).
func (tb *Testbed) ScrapeMetrics(ns, url string) (map[string]float64, error) {
	code, body, err := tb.HTTPGet(ns, url)
	if err != nil {
		return nil, err
	}
	if code != 200 {
		return nil, fmt.Errorf("GET %s: HTTP %d: %s", url, code, body)
	}
	return parseMetrics(string(body)), nil
}

func parseMetrics(text string) map[string]float64 {
	out := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			out[line[:i]] = v
		}
	}
	return out
}

// Sum adds up the samples in m (as ScrapeMetrics keys them) of metric name
// whose labels include every pair of labels.
func Sum(m map[string]float64, name string, labels map[string]string) float64 {
	sum := 0.0
	for key, v := range m {
		if SampleOf(key, name, labels) {
			sum += v
		}
	}
	return sum
}

// SampleOf says whether key (a sample as ScrapeMetrics keys it) is one of
// metric name whose labels include every pair of labels.
func SampleOf(key, name string, labels map[string]string) bool {
	rest, ok := strings.CutPrefix(key, name)
	if !ok {
		return false
	}
	if rest != "" {
		inner, ok := strings.CutPrefix(rest, "{")
		if !ok || !strings.HasSuffix(inner, "}") {
			return false // another metric whose name starts with name
		}
		rest = strings.TrimSuffix(inner, "}")
	}
	for k, v := range labels {
		if !strings.Contains(","+rest+",", ","+k+"="+strconv.Quote(v)+",") {
			return false
		}
	}
	return true
}
