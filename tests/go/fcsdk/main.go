// fcsdk drives ferrovm through a whole life with firecracker-go-sdk's own default
// handlers, as an orchestrator written for Firecracker would: configure, InstanceStart,
// pause, snapshot, stop; then load the snapshot in a new ferrovm and resume it.
//
// Usage: fcsdk FERROVM KERNEL WORKDIR
//
// KERNEL is the migrate-dirty test guest, which prints "migrate-dirty: pass N ..." lines
// with N never decreasing, across a snapshot too. The program prints what it saw and
// "PASS" last; the Rust test (tests/fcsdk.rs) checks the two serial logs as well.
package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"time"

	firecracker "github.com/firecracker-microvm/firecracker-go-sdk"
	"github.com/firecracker-microvm/firecracker-go-sdk/client/models"
	"github.com/sirupsen/logrus"
)

var passLine = regexp.MustCompile(`migrate-dirty: pass (\d+) `)

// lastPass is the highest pass the guest's serial log at path reports, or -1.
func lastPass(path string) int {
	data, _ := os.ReadFile(path)
	last := -1
	for _, m := range passLine.FindAllSubmatch(data, -1) {
		if n, err := strconv.Atoi(string(m[1])); err == nil && n > last {
			last = n
		}
	}
	return last
}

// waitForPass waits until the serial log reports a pass above `above`.
func waitForPass(path string, above int) (int, error) {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if n := lastPass(path); n > above {
			return n, nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return 0, fmt.Errorf("%s: no pass above %d within 30 s", path, above)
}

// command is how the SDK starts the VMM: the ferrovm binary with Firecracker's
// --api-sock, its serial console on a file.
func command(ctx context.Context, bin, socket, serial string) (*exec.Cmd, error) {
	out, err := os.Create(serial)
	if err != nil {
		return nil, err
	}
	return firecracker.VMCommandBuilder{}.
		WithBin(bin).
		WithSocketPath(socket).
		WithStdout(out).
		WithStderr(os.Stderr).
		Build(ctx), nil
}

func logger() *logrus.Entry {
	l := logrus.New()
	l.SetLevel(logrus.WarnLevel)
	return logrus.NewEntry(l)
}

func run(bin, kernel, dir string) error {
	ctx := context.Background()
	first := filepath.Join(dir, "first.serial")
	socket := filepath.Join(dir, "first.sock")
	cmd, err := command(ctx, bin, socket, first)
	if err != nil {
		return err
	}
	cfg := firecracker.Config{
		SocketPath:      socket,
		KernelImagePath: kernel,
		KernelArgs:      "mib=16 report_ms=100",
		MachineCfg: models.MachineConfiguration{
			VcpuCount:  firecracker.Int64(2),
			MemSizeMib: firecracker.Int64(128),
			Smt:        firecracker.Bool(false),
		},
		// ferrovm's own filters (the SDK passes --no-seccomp otherwise).
		Seccomp: firecracker.SeccompConfig{Enabled: true},
	}
	m, err := firecracker.NewMachine(ctx, cfg, firecracker.WithProcessRunner(cmd),
		firecracker.WithLogger(logger()))
	if err != nil {
		return fmt.Errorf("NewMachine: %w", err)
	}
	if err := m.Start(ctx); err != nil {
		return fmt.Errorf("Start: %w", err)
	}
	// Two reports: the guest runs and counts.
	n, err := waitForPass(first, -1)
	if err != nil {
		return err
	}
	if _, err := waitForPass(first, n); err != nil {
		return err
	}
	if err := m.PauseVM(ctx); err != nil {
		return fmt.Errorf("PauseVM: %w", err)
	}
	paused := lastPass(first)
	mem, state := filepath.Join(dir, "vm.mem"), filepath.Join(dir, "vm.snap")
	if err := m.CreateSnapshot(ctx, mem, state); err != nil {
		return fmt.Errorf("CreateSnapshot: %w", err)
	}
	time.Sleep(300 * time.Millisecond)
	if n := lastPass(first); n != paused {
		return fmt.Errorf("the guest ran while paused: pass %d, then %d", paused, n)
	}
	if err := m.StopVMM(); err != nil {
		return fmt.Errorf("StopVMM: %w", err)
	}
	_ = m.Wait(ctx) // SIGTERM: the VMM ends with 128 + 15
	fmt.Printf("fcsdk: first VM paused at pass %d, snapshot written, stopped\n", paused)

	second := filepath.Join(dir, "second.serial")
	socket = filepath.Join(dir, "second.sock")
	if cmd, err = command(ctx, bin, socket, second); err != nil {
		return err
	}
	cfg = firecracker.Config{
		SocketPath: socket,
		Seccomp:    firecracker.SeccompConfig{Enabled: true},
	}
	m, err = firecracker.NewMachine(ctx, cfg, firecracker.WithProcessRunner(cmd),
		firecracker.WithLogger(logger()), firecracker.WithSnapshot(mem, state))
	if err != nil {
		return fmt.Errorf("NewMachine (snapshot): %w", err)
	}
	if err := m.Start(ctx); err != nil {
		return fmt.Errorf("Start (snapshot load): %w", err)
	}
	time.Sleep(300 * time.Millisecond)
	if n := lastPass(second); n != -1 {
		return fmt.Errorf("the loaded guest ran before ResumeVM: pass %d", n)
	}
	if err := m.ResumeVM(ctx); err != nil {
		return fmt.Errorf("ResumeVM: %w", err)
	}
	resumed, err := waitForPass(second, paused)
	if err != nil {
		return err
	}
	if err := m.StopVMM(); err != nil {
		return fmt.Errorf("StopVMM (second): %w", err)
	}
	_ = m.Wait(ctx)
	fmt.Printf("fcsdk: loaded VM resumed and reached pass %d\n", resumed)
	fmt.Println("PASS")
	return nil
}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: fcsdk FERROVM KERNEL WORKDIR")
		os.Exit(2)
	}
	if err := run(os.Args[1], os.Args[2], os.Args[3]); err != nil {
		fmt.Printf("FAIL: %v\n", err)
		os.Exit(1)
	}
}
