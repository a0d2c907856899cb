package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
)

func TestHTTPAnswersTheLine(t *testing.T) {
	srv := httptest.NewServer(answerHTTP(netip.MustParseAddr("10.244.0.5")))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Errorf("status %s", resp.Status)
	}
	// The body names the answering address and the client's, as a TCP answer does.
	if want := "10.244.0.5 127.0.0.1:"; len(body) < len(want) || string(body[:len(want)]) != want || body[len(body)-1] != '\n' {
		t.Errorf("body %q, want %q<port>\\n", body, want)
	}
}
