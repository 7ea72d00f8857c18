/*
 * cpuid-msr: prints what the virtual CPU shows a guest, one line per item,
 * so that two VMMs on the same host can be compared with diff(1):
 *
 *   cpuid LLLLLLLL.SS eax=........ ebx=........ ecx=........ edx=........
 *   msr   NNNNNNNN NAME = 0x................      (or "gp" when RDMSR faults)
 *
 * Every basic, hypervisor (0x40000000-0x40000010) and extended leaf up to
 * the maximum the CPU reports, with the subleaves of the leaves that have
 * them; then a list of MSRs that firmware and the Linux boot path read.
 * Values that change while a guest runs (TSC, APERF/MPERF) are not printed.
 * Ring 0 throughout (RDMSR); a #GP from RDMSR is caught and printed as "gp".
 * Ends with PASS.
 */
#include "kit.h"

/* ---- CPUID ---- */

static void print_leaf(u32 leaf, u32 sub)
{
	struct cpuid_regs r = cpuid(leaf, sub);
	printf("cpuid %08x.%02x eax=%08x ebx=%08x ecx=%08x edx=%08x\n", leaf, sub, r.eax, r.ebx,
	       r.ecx, r.edx);
}

static bool leaf_is_zero(u32 leaf, u32 sub)
{
	struct cpuid_regs r = cpuid(leaf, sub);
	return (r.eax | r.ebx | r.ecx | r.edx) == 0;
}

/* Subleaves of a leaf: 0 always, then up to `max` while not all zero (or,
 * with `all`, every non-zero one up to `max`). */
static void print_subleaves(u32 leaf, u32 max, bool all)
{
	print_leaf(leaf, 0);
	for (u32 sub = 1; sub <= max; sub++) {
		if (leaf_is_zero(leaf, sub)) {
			if (all)
				continue;
			return;
		}
		print_leaf(leaf, sub);
	}
}

static void print_leaf_range(u32 first, u32 last)
{
	for (u32 leaf = first; leaf <= last; leaf++) {
		switch (leaf) {
		case 0x4:		/* deterministic cache parameters */
		case 0x8000001d:
		case 0xb:		/* extended topology: ends with a type-0 level */
		case 0x1f:
			print_subleaves(leaf, 7, false);
			break;
		case 0x7:
			print_subleaves(leaf, cpuid(7, 0).eax > 3 ? 3 : cpuid(7, 0).eax, true);
			break;
		case 0xd:		/* XSAVE components */
			print_subleaves(leaf, 63, true);
			break;
		case 0xf: case 0x10: case 0x12: case 0x14: case 0x17: case 0x18:
		case 0x1d: case 0x1e: case 0x20: case 0x23: case 0x24:
		case 0x80000020: case 0x80000026:
			print_subleaves(leaf, 3, true);
			break;
		default:
			print_leaf(leaf, 0);
		}
	}
}

/* ---- MSRs ---- */

struct msr_name {
	u32 index;
	const char *name;
};

static const struct msr_name msrs[] = {
	{ 0x0000001b, "APIC_BASE" },
	{ 0x0000003a, "FEATURE_CONTROL" },
	{ 0x0000003b, "TSC_ADJUST" },
	{ 0x00000048, "SPEC_CTRL" },
	{ 0x0000008b, "MICROCODE_REV" },
	{ 0x000000ce, "PLATFORM_INFO" },
	{ 0x000000fe, "MTRRCAP" },
	{ 0x0000010a, "ARCH_CAPABILITIES" },
	{ 0x00000140, "MISC_FEATURES_ENABLES" },
	{ 0x00000174, "SYSENTER_CS" },
	{ 0x00000179, "MCG_CAP" },
	{ 0x0000017a, "MCG_STATUS" },
	{ 0x0000017b, "MCG_CTL" },
	{ 0x000001a0, "MISC_ENABLE" },
	{ 0x000001d9, "DEBUGCTL" },
	{ 0x00000200, "MTRR_PHYSBASE0" },
	{ 0x00000201, "MTRR_PHYSMASK0" },
	{ 0x00000250, "MTRR_FIX64K_00000" },
	{ 0x00000258, "MTRR_FIX16K_80000" },
	{ 0x00000268, "MTRR_FIX4K_C0000" },
	{ 0x00000277, "PAT" },
	{ 0x000002ff, "MTRR_DEF_TYPE" },
	{ 0x00000400, "MC0_CTL" },
	{ 0x00000401, "MC0_STATUS" },
	{ 0x000006e0, "TSC_DEADLINE" },
	{ 0xc0000080, "EFER" },
	{ 0xc0000103, "TSC_AUX" },
	{ 0xc0000104, "AMD64_TSC_RATIO" },
	{ 0xc00000e9, "F17H_IRPERF" },
	{ 0xc0010000, "K7_EVNTSEL0" },
	{ 0xc0010004, "K7_PERFCTR0" },
	{ 0xc0010010, "AMD64_SYSCFG" },
	{ 0xc0010015, "K7_HWCR" },
	{ 0xc0010016, "K8_IORR_BASE0" },
	{ 0xc001001a, "K8_TOP_MEM1" },
	{ 0xc001001d, "K8_TOP_MEM2" },
	{ 0xc0010055, "K8_INT_PENDING_MSG" },
	{ 0xc0010058, "FAM10H_MMIO_CONF_BASE" },
	{ 0xc0010061, "AMD_PSTATE_LIMIT" },
	{ 0xc0010062, "AMD_PERF_CTL" },
	{ 0xc0010063, "AMD_PERF_STATUS" },
	{ 0xc0010064, "AMD_PSTATE_DEF0" },
	{ 0xc0010112, "K8_TSEG_ADDR" },
	{ 0xc0010114, "VM_CR" },
	{ 0xc0010117, "VM_HSAVE_PA" },
	{ 0xc001011f, "AMD64_VIRT_SPEC_CTRL" },
	{ 0xc0010131, "AMD64_SEV" },
	{ 0xc0010140, "AMD64_OSVW_ID_LENGTH" },
	{ 0xc0010141, "AMD64_OSVW_STATUS" },
	{ 0xc0010200, "F15H_PERF_CTL0" },
	{ 0xc00102b0, "AMD_CPPC_CAP1" },
	{ 0xc00102f0, "AMD_PPIN_CTL" },
	{ 0xc0011004, "AMD64_CPUID_FN_1" },
	{ 0xc001100c, "FAM10H_NODE_ID" },
	{ 0xc0011020, "AMD64_LS_CFG" },
	{ 0xc0011021, "AMD64_IC_CFG" },
	{ 0xc0011022, "AMD64_DC_CFG" },
	{ 0xc0011029, "AMD64_DE_CFG" },
	{ 0xc001102a, "AMD64_BU_CFG2" },
	{ 0xc001102e, "ZEN4_BP_CFG" },
	{ 0xc00110e3, "ZEN2_SPECTRAL_CHICKEN" },
	{ 0x4b564d00, "KVM_WALL_CLOCK_NEW" },
	{ 0x4b564d01, "KVM_SYSTEM_TIME_NEW" },
	{ 0x4b564d02, "KVM_ASYNC_PF_EN" },
	{ 0x4b564d04, "KVM_PV_EOI_EN" },
	{ 0x4b564d05, "KVM_POLL_CONTROL" },
};

/* rdmsr_probe() returns here, with faulted set, when its RDMSR takes #GP. */
extern char rdmsr_insn[], rdmsr_resume[];
static volatile bool faulted;

/* Reads MSR `index`: true and *value, or false if RDMSR raised #GP. */
static bool rdmsr_probe(u32 index, u64 *value)
{
	u32 lo = 0, hi = 0;
	faulted = false;
	__asm__ volatile(".globl rdmsr_insn\n"
			 "rdmsr_insn: rdmsr\n"
			 ".globl rdmsr_resume\n"
			 "rdmsr_resume:"
			 : "+a"(lo), "+d"(hi)
			 : "c"(index)
			 : "memory");
	*value = ((u64)hi << 32) | lo;
	return !faulted;
}

static void gp_handler(struct frame *f)
{
	if (f->rip != (u64)rdmsr_insn)
		fatal_trap(f);
	faulted = true;
	f->rip = (u64)rdmsr_resume;
}

static void print_msrs(void)
{
	set_handler(13, gp_handler);
	for (size_t i = 0; i < ARRAY_SIZE(msrs); i++) {
		u64 value;
		if (rdmsr_probe(msrs[i].index, &value))
			printf("msr %08x %s = 0x%016lx\n", msrs[i].index, msrs[i].name, value);
		else
			printf("msr %08x %s gp\n", msrs[i].index, msrs[i].name);
	}
	set_handler(13, NULL);
}

void guest_main(void)
{
	u32 max_basic = cpuid(0, 0).eax;
	u32 max_ext = cpuid(0x80000000, 0).eax;
	bool hypervisor = (cpuid(1, 0).ecx >> 31) & 1;

	print_leaf_range(0, max_basic > 0x40 ? 0x40 : max_basic);
	if (hypervisor)
		print_leaf_range(0x40000000, 0x40000010);
	if (max_ext >= 0x80000000)
		print_leaf_range(0x80000000, max_ext > 0x80000040 ? 0x80000040 : max_ext);
	print_msrs();
	pass();
}
