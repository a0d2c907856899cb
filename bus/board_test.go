package bus_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/kpipe/kpipe/bus"
)

func TestBoardUpdateChangesInPlace(t *testing.T) {
	b := bus.NewBoard()
	if got := b.Read(); len(got) != 0 {
		t.Fatalf("new board holds %v", got)
	}
	t0 := time.Unix(1000, 0)
	b.Publish("commit-ipv4", bus.Report{LastSync: t0, Generation: 1})
	b.Update("commit-ipv4", func(r *bus.Report) { r.Errors++; r.LastError = "boom" })
	got := b.Read()["commit-ipv4"]
	if !got.LastSync.Equal(t0) || got.Generation != 1 {
		t.Errorf("Update lost fields it did not touch: %+v", got)
	}
	if got.Errors != 1 || got.LastError != "boom" {
		t.Errorf("Update not applied: %+v", got)
	}
	// Update of a stage nobody published yet starts from an empty report.
	b.Update("coalesce-ipv4", func(r *bus.Report) { r.PendingSince = t0 })
	if got := b.Read()["coalesce-ipv4"]; !got.PendingSince.Equal(t0) || got.Errors != 0 {
		t.Errorf("Update of a new stage = %+v", got)
	}
	// Publish replaces the whole report.
	b.Publish("commit-ipv4", bus.Report{Generation: 2})
	if got := b.Read()["commit-ipv4"]; got.Errors != 0 || !got.LastSync.IsZero() || got.Generation != 2 {
		t.Errorf("Publish did not replace the report: %+v", got)
	}
}

func TestBoardReadReturnsACopy(t *testing.T) {
	b := bus.NewBoard()
	b.Publish("watch", bus.Report{Generation: 7})
	got := b.Read()
	got["watch"] = bus.Report{Generation: 8}
	got["intruder"] = bus.Report{}
	delete(got, "watch")
	again := b.Read()
	if again["watch"].Generation != 7 {
		t.Errorf("a reader's change to Read's map reached the board: %+v", again["watch"])
	}
	if _, ok := again["intruder"]; ok || len(again) != 1 {
		t.Errorf("board = %v; want only watch", again)
	}
	// And a later Update does not reach a map read before it.
	snapshot := b.Read()
	b.Update("watch", func(r *bus.Report) { r.Generation = 9 })
	if snapshot["watch"].Generation != 7 {
		t.Errorf("an Update changed a map already returned by Read: %+v", snapshot["watch"])
	}
}

func TestBoardConcurrentUpdates(t *testing.T) {
	const writers, per = 16, 500
	b := bus.NewBoard()
	stages := []bus.StageName{"a", "b", "c"}
	var wg sync.WaitGroup
	for i := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			stage := stages[i%len(stages)]
			for range per {
				b.Update(stage, func(r *bus.Report) { r.Errors++ })
			}
		}()
	}
	stop := make(chan struct{})
	var rwg sync.WaitGroup
	for range 4 {
		rwg.Add(1)
		go func() {
			defer rwg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				for _, r := range b.Read() {
					_ = r.Errors
				}
				b.Publish("reader", bus.Report{Generation: 1})
			}
		}()
	}
	wg.Wait()
	close(stop)
	rwg.Wait()
	got := b.Read()
	var total uint64
	for _, s := range stages {
		total += got[s].Errors
	}
	if total != writers*per {
		t.Fatalf("concurrent Updates counted %d; want %d (an update was lost)", total, writers*per)
	}
	for i, s := range stages {
		want := uint64(0)
		for w := range writers {
			if w%len(stages) == i {
				want += per
			}
		}
		if got[s].Errors != want {
			t.Errorf("stage %s: %d; want %d", s, got[s].Errors, want)
		}
	}
}

func TestBoardCarriesLastErrorAt(t *testing.T) {
	b := bus.NewBoard()
	at := time.Unix(2000, 0)
	b.Update("canary", func(r *bus.Report) { r.Errors++; r.LastError = "boom"; r.LastErrorAt = at })
	if got := b.Read()["canary"]; got.Errors != 1 || got.LastError != "boom" || !got.LastErrorAt.Equal(at) {
		t.Errorf("report = %+v; want one error, boom, at %v", got, at)
	}
}

// A stage's reporter writes its own entry, and Of the entry of one family.
func TestReporterWritesItsStagesEntry(t *testing.T) {
	b := bus.NewBoard()
	env := bus.Envs{Board: b}.For(bus.Coalesce)
	env.Status.Update(func(r *bus.Report) { r.Generation = 1 })
	env.Status.Of(bus.IPv6).Update(func(r *bus.Report) { r.Generation = 2 })
	bus.Envs{Board: b}.For(bus.Commit.Of(bus.IPv4)).Status.Failed(errors.New("boom"), time.Unix(5, 0))
	got := b.Read()
	if got["coalesce"].Generation != 1 || got["coalesce-ipv6"].Generation != 2 || len(got) != 3 {
		t.Errorf("board = %+v; want coalesce and coalesce-ipv6", got)
	}
	if r := got["commit-ipv4"]; r.Errors != 1 || r.LastError != "boom" || !r.LastErrorAt.Equal(time.Unix(5, 0)) {
		t.Errorf("commit-ipv4 = %+v; want one failure, boom", r)
	}
}

func TestSignalsAreFlags(t *testing.T) {
	resend, resync, replay := bus.NewResendFlag(), bus.NewResyncFlag(), bus.NewReplayFlag()
	resend.Raise()
	if resync.Lower() || replay.Lower() {
		t.Fatal("raising resend raised another flag")
	}
	select {
	case <-resend.C():
	default:
		t.Fatal("raised resend flag not receivable")
	}
}

func TestNoBoardIsAProgrammingError(t *testing.T) {
	defer func() {
		if r := recover(); r == nil {
			t.Error("Envs.For without a Board made an Env: its reports would reach nobody")
		}
	}()
	bus.Envs{}.For(bus.Coalesce)
}
