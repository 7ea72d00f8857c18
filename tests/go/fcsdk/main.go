// fcsdk drives ferrovm through a whole life with firecracker-go-sdk's own default
// handlers, as an orchestrator written for Firecracker would: configure a machine with a
// drive, a network interface and a vsock device, InstanceStart, pause, snapshot, stop;
// then load the snapshot in a new ferrovm (which rebuilds the devices from the snapshot,
// as Firecracker does) and resume it.
//
// Usage: fcsdk FERROVM KERNEL WORKDIR TAP
//
// KERNEL is the migrate-dirty test guest, which prints "migrate-dirty: pass N ..." lines
// with N never decreasing, across a snapshot too; or blk-stress, whose "stress: round N ok"
// lines say it wrote the drive and read it back intact; or the Linux test guest's vmlinux
// (its initramfs.cpio beside it), which runs the counter test on the drive, an ext4 image:
// "FERROVM-COUNT i=N" once a second, each number appended to /count and synced; the loaded
// VM counts to the end and powers off by itself. WORKDIR holds disk.img, the drive's
// image; TAP is the tap the network interface uses (created by the VMM). The program
// prints what it saw and "PASS" last; the Rust test (tests/fcsdk.rs) checks the two serial
// logs as well (and for Linux the drive's filesystem), and deletes the tap.
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	firecracker "github.com/firecracker-microvm/firecracker-go-sdk"
	"github.com/firecracker-microvm/firecracker-go-sdk/client/models"
	"github.com/sirupsen/logrus"
)

// The guest's progress lines: migrate-dirty counts passes over its memory; blk-stress
// (chosen by the kernel's file name) counts rounds of writes and checked reads on the
// drive, so that a loaded VM proves its disk works.
var (
	passLine   = regexp.MustCompile(`migrate-dirty: pass (\d+) `)
	kernelArgs = "mib=16 report_ms=100"
	// How long a pass may take to come (Linux boots for minutes here).
	passLimit = 30 * time.Second
	vcpus     = int64(2)
	memMiB    = int64(128)
	// The Linux guest's initramfs; with it the loaded VM runs to its own power-off.
	initrd = ""
)

func useBlkStress() {
	passLine = regexp.MustCompile(`stress: round (\d+) ok: `)
	kernelArgs = "rounds=0 wait=hlt"
}

func useLinux(kernel string) {
	passLine = regexp.MustCompile(`FERROVM-COUNT i=(\d+)`)
	kernelArgs = "console=ttyS0 nmi_watchdog=0 rcupdate.rcu_cpu_stall_suppress=1 " +
		"tsc=reliable ferrovm.test=counter ferrovm.counter.until=" + linuxCountTo
	passLimit = 20 * time.Minute
	vcpus, memMiB = 1, 256
	initrd = filepath.Join(filepath.Dir(kernel), "initramfs.cpio")
}

// The Linux guest's last count (tests/fcsdk.rs checks /count against it).
const linuxCountTo = "20"

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
	deadline := time.Now().Add(passLimit)
	for time.Now().Before(deadline) {
		if n := lastPass(path); n > above {
			return n, nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return 0, fmt.Errorf("%s: no pass above %d within %v", path, above, passLimit)
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

// The guest's devices: where the SDK puts them.
type devices struct {
	disk, tap, vsock string
}

const guestMAC = "02:fc:00:00:00:01"

// checkDevices proves that the VMM with process id pid has the devices: it holds the
// drive's image open, the tap exists on the host, and the VMM listens on the vsock socket
// (it holds the socket bound at that path, and a host process can connect to it). The
// migrate-dirty guest does not drive the devices: a CONNECT would wait for the guest's
// driver, so none is sent.
func checkDevices(pid int, d devices) error {
	if !holdsOpen(pid, d.disk) {
		return fmt.Errorf("the VMM (pid %d) does not hold the drive %s open", pid, d.disk)
	}
	if _, err := os.Stat(filepath.Join("/sys/class/net", d.tap)); err != nil {
		return fmt.Errorf("the tap %s does not exist: %w", d.tap, err)
	}
	inode, err := unixSocketInode(d.vsock)
	if err != nil {
		return err
	}
	if !holdsOpen(pid, fmt.Sprintf("socket:[%s]", inode)) {
		return fmt.Errorf("the VMM (pid %d) does not hold the vsock socket %s", pid, d.vsock)
	}
	conn, err := net.Dial("unix", d.vsock)
	if err != nil {
		return fmt.Errorf("vsock socket %s: %w", d.vsock, err)
	}
	return conn.Close()
}

// unixSocketInode is the inode of the Unix socket bound at path, from /proc/net/unix.
func unixSocketInode(path string) (string, error) {
	table, err := os.ReadFile("/proc/net/unix")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(table), "\n") {
		// Num RefCount Protocol Flags Type St Inode Path
		if f := strings.Fields(line); len(f) == 8 && f[7] == path {
			return f[6], nil
		}
	}
	return "", fmt.Errorf("no Unix socket is bound at %s", path)
}

// killOnFailure ends the VMM the SDK started if the program fails before stopping it: it
// would otherwise run on, holding the tap and the test's output pipe.
func killOnFailure(cmd *exec.Cmd) {
	if cmd.Process != nil && cmd.ProcessState == nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
}

// holdsOpen says whether process pid has path open.
func holdsOpen(pid int, path string) bool {
	fds, _ := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", pid))
	for _, fd := range fds {
		if target, err := os.Readlink(fd); err == nil && target == path {
			return true
		}
	}
	return false
}

func run(bin, kernel, dir, tap string) error {
	dev := devices{
		disk:  filepath.Join(dir, "disk.img"),
		tap:   tap,
		vsock: filepath.Join(dir, "v.sock"),
	}
	ctx := context.Background()
	first := filepath.Join(dir, "first.serial")
	socket := filepath.Join(dir, "first.sock")
	cmd, err := command(ctx, bin, socket, first)
	if err != nil {
		return err
	}
	defer killOnFailure(cmd)
	cfg := firecracker.Config{
		SocketPath:      socket,
		KernelImagePath: kernel,
		InitrdPath:      initrd,
		KernelArgs:      kernelArgs,
		MachineCfg: models.MachineConfiguration{
			VcpuCount:  firecracker.Int64(vcpus),
			MemSizeMib: firecracker.Int64(memMiB),
			Smt:        firecracker.Bool(false),
		},
		Drives: []models.Drive{{
			DriveID:      firecracker.String("data"),
			PathOnHost:   firecracker.String(dev.disk),
			IsRootDevice: firecracker.Bool(false),
			IsReadOnly:   firecracker.Bool(false),
		}},
		NetworkInterfaces: firecracker.NetworkInterfaces{{
			StaticConfiguration: &firecracker.StaticNetworkConfiguration{
				HostDevName: dev.tap,
				MacAddress:  guestMAC,
			},
		}},
		VsockDevices: []firecracker.VsockDevice{{ID: "vsock0", Path: dev.vsock, CID: 3}},
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
	if err := checkDevices(cmd.Process.Pid, dev); err != nil {
		return fmt.Errorf("first VM: %w", err)
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
	defer killOnFailure(cmd)
	// No devices here: the snapshot brings them (the SDK would PUT /vsock after the load,
	// which Firecracker refuses as well).
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
	if err := checkDevices(cmd.Process.Pid, dev); err != nil {
		return fmt.Errorf("loaded VM: %w", err)
	}
	// The guest still runs after the device checks.
	if _, err := waitForPass(second, resumed); err != nil {
		return err
	}
	if initrd != "" {
		// Linux counts to the end, unmounts and powers off: the VMM ends with 0.
		if err := m.Wait(ctx); err != nil {
			return fmt.Errorf("the loaded Linux did not power off cleanly: %w", err)
		}
		fmt.Printf("fcsdk: loaded Linux counted to %d and powered off\n", lastPass(second))
	} else {
		if err := m.StopVMM(); err != nil {
			return fmt.Errorf("StopVMM (second): %w", err)
		}
		_ = m.Wait(ctx)
	}
	fmt.Printf("fcsdk: loaded VM resumed and reached pass %d; drive, tap %s and vsock socket in place\n",
		resumed, dev.tap)
	fmt.Println("PASS")
	return nil
}

func main() {
	if len(os.Args) != 5 {
		fmt.Fprintln(os.Stderr, "usage: fcsdk FERROVM KERNEL WORKDIR TAP")
		os.Exit(2)
	}
	switch base := filepath.Base(os.Args[2]); {
	case strings.Contains(base, "blk-stress"):
		useBlkStress()
	case base == "vmlinux":
		useLinux(os.Args[2])
	}
	if err := run(os.Args[1], os.Args[2], os.Args[3], os.Args[4]); err != nil {
		fmt.Printf("FAIL: %v\n", err)
		os.Exit(1)
	}
}
