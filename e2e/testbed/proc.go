package testbed

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"
)

// spawner starts child processes from one OS thread that never exits and never
// leaves the root network namespace. Children get SIGKILL when that thread dies
// (Pdeathsig), which with a thread that lives as long as the process means: when
// the test process dies, however it dies, its children die with it.
type spawner struct {
	reqs chan spawnReq
}

type spawnReq struct {
	cmd  *exec.Cmd
	done chan error
}

var (
	spawnerOnce sync.Once
	theSpawner  *spawner
)

func getSpawner() *spawner {
	spawnerOnce.Do(func() {
		s := &spawner{reqs: make(chan spawnReq)}
		go func() {
			runtime.LockOSThread() // never unlocked: this thread lives as long as the process
			for r := range s.reqs {
				r.done <- r.cmd.Start()
			}
		}()
		theSpawner = s
	})
	return theSpawner
}

func startCmd(cmd *exec.Cmd) error {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	done := make(chan error, 1)
	getSpawner().reqs <- spawnReq{cmd: cmd, done: done}
	return <-done
}

// Process is a long-running child started by the test bed, with its output in a
// log file.
type Process struct {
	Name    string
	LogPath string

	cmd     *exec.Cmd
	logFile *os.File
	done    chan struct{}
	waitErr error
}

// startProcess starts argv with stdout and stderr appended to logPath.
func startProcess(name, logPath string, env []string, argv ...string) (*Process, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open log of %s: %w", name, err)
	}
	fmt.Fprintf(f, "=== %s: %s\n", time.Now().Format(time.RFC3339Nano), strings.Join(argv, " "))
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout = f
	cmd.Stderr = f
	cmd.Env = env
	if err := startCmd(cmd); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Process{Name: name, LogPath: logPath, cmd: cmd, logFile: f, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		fmt.Fprintf(f, "=== %s: exited: %v\n", time.Now().Format(time.RFC3339Nano), cmd.ProcessState)
		f.Close()
		close(p.done)
	}()
	return p, nil
}

// PID is the process id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Done is closed when the process has ended.
func (p *Process) Done() <-chan struct{} { return p.done }

// ExitErr is what Wait returned; valid after Done.
func (p *Process) ExitErr() error { return p.waitErr }

// Stop sends SIGTERM, waits up to grace, then SIGKILLs. It returns the exit error
// of the process (nil if it exited 0) or an error if it had to be killed.
func (p *Process) Stop(grace time.Duration) error {
	if p.Exited() {
		return p.waitErr
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.waitErr
	case <-time.After(grace):
	}
	_ = p.cmd.Process.Kill()
	<-p.done
	return fmt.Errorf("%s did not exit within %v of SIGTERM; killed", p.Name, grace)
}

// Tail returns the last n lines of the process's log.
func (p *Process) Tail(n int) string { return tailFile(p.LogPath, n) }

func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	return tailLines(string(b), n)
}

func tailLines(s string, n int) string {
	s = strings.TrimRight(s, "\n")
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Run runs argv to completion and returns its stdout; a failure carries stderr.
func Run(argv ...string) (string, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := startCmd(cmd); err != nil {
		return "", fmt.Errorf("run %s: %w", strings.Join(argv, " "), err)
	}
	if err := cmd.Wait(); err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return stdout.String(), fmt.Errorf("run %s: %w: %s", strings.Join(argv, " "), err, strings.TrimSpace(stderr.String()))
		}
		return stdout.String(), fmt.Errorf("run %s: %w", strings.Join(argv, " "), err)
	}
	return stdout.String(), nil
}
