/*
 * rawkvm: the floor for exit round trips — a minimal VMM around one KVM_RUN loop.
 *
 *   rawkvm [-m MiB] [-c CMDLINE] KERNEL.elf
 *
 * Boots a PVH ELF (the guests in target/guests) the way ferrovm does, with nothing else:
 * one memory slot at 0 (anonymous, MAP_NORESERVE, advised for huge pages as ferrovm and
 * QEMU do), PT_LOAD segments copied in, hvm_start_info at 0x7000 with the command line
 * and a two-entry memory map, the boot GDT at 0x500, one vCPU in 32-bit flat protected
 * mode at the XEN_ELFNOTE_PHYS32_ENTRY address with EBX = 0x7000, the host's supported
 * CPUID.  No irqchip, no timers, no devices: exits are answered inline —
 *
 *   OUT 0x3f8            byte to stdout (the guest's console)
 *   IN  0x3fd            0x60 (LSR: transmitter empty)
 *   0x3ff                a scratch register
 *   OUT 0xf4 (v)         exit with status (v << 1) | 1, as ferrovm and isa-debug-exit
 *   other IN / MMIO read all ones; other OUT / MMIO write ignored
 *   HLT                  exit 0
 *
 * anything else ends with status 2 and one line naming the exit.
 */
#define _GNU_SOURCE
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/kvm.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GDT_ADDR	0x500
#define START_INFO	0x7000
#define MEMMAP_ADDR	0x9000
#define CMDLINE_ADDR	0x20000
#define HIMEM		0x100000
#define XEN_HVM_START_MAGIC 0x336ec578u
#define XEN_ELFNOTE_PHYS32_ENTRY 18

struct hvm_start_info {
	uint32_t magic, version, flags, nr_modules;
	uint64_t modlist_paddr, cmdline_paddr, rsdp_paddr, memmap_paddr;
	uint32_t memmap_entries, reserved;
};
struct hvm_memmap_entry {
	uint64_t addr, size;
	uint32_t type, reserved;
};

static void die(const char *what)
{
	fprintf(stderr, "rawkvm: %s: %s\n", what, strerror(errno));
	exit(2);
}

static void fail(const char *fmt, const char *arg)
{
	fprintf(stderr, "rawkvm: ");
	fprintf(stderr, fmt, arg);
	fputc('\n', stderr);
	exit(2);
}

static char out_buf[4096];
static size_t out_len;

static void out_flush(void)
{
	if (out_len && write(1, out_buf, out_len) < 0) {
		/* nothing to do: the console is best effort */
	}
	out_len = 0;
}

static void out_byte(uint8_t c)
{
	out_buf[out_len++] = (char)c;
	if (c == '\n' || out_len == sizeof(out_buf))
		out_flush();
}

/* Loads the ELF's PT_LOAD segments into guest memory; returns the PVH entry point. */
static uint64_t load_elf(const char *path, uint8_t *mem, uint64_t mem_size)
{
	int fd = open(path, O_RDONLY);
	if (fd < 0)
		die(path);
	struct stat st;
	if (fstat(fd, &st) < 0)
		die(path);
	uint8_t *f = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
	if (f == MAP_FAILED)
		die(path);
	close(fd);
	const Elf64_Ehdr *eh = (const Elf64_Ehdr *)f;
	if ((size_t)st.st_size < sizeof(*eh) || memcmp(eh->e_ident, ELFMAG, SELFMAG) ||
	    eh->e_ident[EI_CLASS] != ELFCLASS64)
		fail("%s: not an ELF64 image", path);
	uint64_t entry = 0;
	for (int i = 0; i < eh->e_phnum; i++) {
		const Elf64_Phdr *ph = (const Elf64_Phdr *)(f + eh->e_phoff + (size_t)i * eh->e_phentsize);
		if (ph->p_type == PT_LOAD) {
			if (ph->p_paddr + ph->p_memsz > mem_size || ph->p_offset + ph->p_filesz > (uint64_t)st.st_size)
				fail("%s: segment outside guest memory or file", path);
			memcpy(mem + ph->p_paddr, f + ph->p_offset, ph->p_filesz);
			memset(mem + ph->p_paddr + ph->p_filesz, 0, ph->p_memsz - ph->p_filesz);
		} else if (ph->p_type == PT_NOTE) {
			uint64_t off = ph->p_offset, end = ph->p_offset + ph->p_filesz;
			while (off + 12 <= end) {
				const uint32_t *n = (const uint32_t *)(f + off);
				uint32_t namesz = n[0], descsz = n[1], type = n[2];
				const char *name = (const char *)(n + 3);
				const uint8_t *desc = (const uint8_t *)name + ((namesz + 3) & ~3u);
				if (type == XEN_ELFNOTE_PHYS32_ENTRY && namesz == 4 && !memcmp(name, "Xen", 4))
					entry = descsz >= 8 ? *(const uint64_t *)desc : *(const uint32_t *)desc;
				off += 12 + ((namesz + 3) & ~3u) + ((descsz + 3) & ~3u);
			}
		}
	}
	if (!entry)
		fail("%s: no XEN_ELFNOTE_PHYS32_ENTRY note (not a PVH image)", path);
	munmap(f, (size_t)st.st_size);
	return entry;
}

static void set_seg(struct kvm_segment *s, uint16_t sel, uint8_t type)
{
	*s = (struct kvm_segment){
		.base = 0, .limit = 0xffffffff, .selector = sel, .type = type,
		.present = 1, .dpl = 0, .db = 1, .s = 1, .l = 0, .g = 1,
	};
}

int main(int argc, char **argv)
{
	uint64_t mem_mib = 256;
	const char *cmdline = "";
	int opt;
	while ((opt = getopt(argc, argv, "m:c:")) != -1) {
		if (opt == 'm')
			mem_mib = strtoull(optarg, NULL, 0);
		else if (opt == 'c')
			cmdline = optarg;
		else
			fail("usage: rawkvm [-m MiB] [-c CMDLINE] KERNEL.elf%s", "");
	}
	if (optind + 1 != argc)
		fail("usage: rawkvm [-m MiB] [-c CMDLINE] KERNEL.elf%s", "");
	if (mem_mib < 16 || mem_mib > 3072)
		fail("-m %s: 16 to 3072 MiB", argv[optind - 1]);
	uint64_t mem_size = mem_mib << 20;

	int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
	if (kvm < 0)
		die("/dev/kvm");
	int vm = ioctl(kvm, KVM_CREATE_VM, 0);
	if (vm < 0)
		die("KVM_CREATE_VM");
	ioctl(vm, KVM_SET_TSS_ADDR, 0xfffbd000ul);	/* VMX needs it; others ignore or refuse */

	uint8_t *mem = mmap(NULL, mem_size, PROT_READ | PROT_WRITE,
			    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (mem == MAP_FAILED)
		die("mmap guest memory");
	madvise(mem, mem_size, MADV_HUGEPAGE);
	struct kvm_userspace_memory_region region = {
		.slot = 0, .guest_phys_addr = 0, .memory_size = mem_size,
		.userspace_addr = (uint64_t)(uintptr_t)mem,
	};
	if (ioctl(vm, KVM_SET_USER_MEMORY_REGION, &region) < 0)
		die("KVM_SET_USER_MEMORY_REGION");

	uint64_t entry = load_elf(argv[optind], mem, mem_size);
	static const uint64_t gdt[4] = { 0, 0, 0x00cf9b000000ffffull, 0x00cf93000000ffffull };
	memcpy(mem + GDT_ADDR, gdt, sizeof(gdt));
	size_t cl = strlen(cmdline);
	if (cl > 65535)
		fail("command line too long%s", "");
	memcpy(mem + CMDLINE_ADDR, cmdline, cl + 1);
	struct hvm_memmap_entry mm[2] = {
		{ .addr = 0, .size = 0x9fc00, .type = 1 },
		{ .addr = HIMEM, .size = mem_size - HIMEM, .type = 1 },
	};
	memcpy(mem + MEMMAP_ADDR, mm, sizeof(mm));
	struct hvm_start_info si = {
		.magic = XEN_HVM_START_MAGIC, .version = 1,
		.cmdline_paddr = CMDLINE_ADDR, .memmap_paddr = MEMMAP_ADDR, .memmap_entries = 2,
	};
	memcpy(mem + START_INFO, &si, sizeof(si));

	int vcpu = ioctl(vm, KVM_CREATE_VCPU, 0);
	if (vcpu < 0)
		die("KVM_CREATE_VCPU");
	int run_size = ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
	if (run_size < 0)
		die("KVM_GET_VCPU_MMAP_SIZE");
	struct kvm_run *run = mmap(NULL, (size_t)run_size, PROT_READ | PROT_WRITE, MAP_SHARED, vcpu, 0);
	if (run == MAP_FAILED)
		die("mmap kvm_run");

	int nent = 256;
	struct kvm_cpuid2 *cpuid = calloc(1, sizeof(*cpuid) + nent * sizeof(struct kvm_cpuid_entry2));
	cpuid->nent = (uint32_t)nent;
	if (ioctl(kvm, KVM_GET_SUPPORTED_CPUID, cpuid) < 0)
		die("KVM_GET_SUPPORTED_CPUID");
	if (ioctl(vcpu, KVM_SET_CPUID2, cpuid) < 0)
		die("KVM_SET_CPUID2");

	struct kvm_sregs sregs;
	if (ioctl(vcpu, KVM_GET_SREGS, &sregs) < 0)
		die("KVM_GET_SREGS");
	set_seg(&sregs.cs, 0x10, 0xb);
	set_seg(&sregs.ds, 0x18, 0x3);
	sregs.es = sregs.fs = sregs.gs = sregs.ss = sregs.ds;
	sregs.gdt.base = GDT_ADDR;
	sregs.gdt.limit = sizeof(gdt) - 1;
	sregs.cr0 = 0x11;
	sregs.cr4 = 0;
	sregs.efer = 0;
	if (ioctl(vcpu, KVM_SET_SREGS, &sregs) < 0)
		die("KVM_SET_SREGS");
	struct kvm_regs regs = { .rip = entry, .rbx = START_INFO, .rflags = 2 };
	if (ioctl(vcpu, KVM_SET_REGS, &regs) < 0)
		die("KVM_SET_REGS");

	uint8_t scratch = 0;
	for (;;) {
		if (ioctl(vcpu, KVM_RUN, 0) < 0) {
			if (errno == EINTR || errno == EAGAIN)
				continue;
			die("KVM_RUN");
		}
		switch (run->exit_reason) {
		case KVM_EXIT_IO: {
			uint8_t *d = (uint8_t *)run + run->io.data_offset;
			for (uint32_t i = 0; i < run->io.count; i++, d += run->io.size) {
				uint16_t port = run->io.port;
				if (run->io.direction == KVM_EXIT_IO_OUT) {
					if (port == 0x3f8)
						out_byte(d[0]);
					else if (port == 0x3ff)
						scratch = d[0];
					else if (port == 0xf4) {
						out_flush();
						return (d[0] << 1) | 1;
					}
				} else {
					memset(d, 0xff, run->io.size);
					if (port == 0x3fd)
						d[0] = 0x60;
					else if (port == 0x3ff)
						d[0] = scratch;
				}
			}
			break;
		}
		case KVM_EXIT_MMIO:
			if (!run->mmio.is_write)
				memset(run->mmio.data, 0xff, run->mmio.len);
			break;
		case KVM_EXIT_HLT:
			out_flush();
			return 0;
		case KVM_EXIT_INTR:
			break;
		default:
			out_flush();
			fprintf(stderr, "rawkvm: unexpected exit reason %u", run->exit_reason);
			if (ioctl(vcpu, KVM_GET_REGS, &regs) == 0)
				fprintf(stderr, " at rip=0x%llx", (unsigned long long)regs.rip);
			if (run->exit_reason == KVM_EXIT_INTERNAL_ERROR)
				fprintf(stderr, " (internal error, suberror %u)", run->internal.suberror);
			fputc('\n', stderr);
			return 2;
		}
	}
}
