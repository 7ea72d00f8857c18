/*
 * complete: the instructions ferrovm completes when the host's emulator rejects them,
 * each run once in ring 0 (emulated on PVM hosts, so completed by ferrovm there) and
 * once natively in ring 3, with the two results compared.  Instructions that are
 * privileged (XSAVES, XRSTORS) or trap (INT3) are checked against what the
 * architecture says instead.  MOVBE is not here: KVM's emulator answers it with #UD
 * itself on PVM hosts, without asking user space.  On VT-x/AMD-V hosts both runs are native and agree too.
 *
 * Prints "complete: NAME ok" per check, then PASS; any difference is a FAIL naming the
 * instruction and both values.  With `unknown=1` on the command line it runs, in ring 0,
 * an instruction ferrovm does not complete (AESENC): on hosts that need completion the
 * VMM must stop with one line naming it.
 */
#include "kit.h"

#define CR0_EM		(1u << 2)
#define CR0_TS		(1u << 3)
#define CR4_OSFXSR	(1u << 9)
#define CR4_OSXMMEXCPT	(1u << 10)
#define CR4_FSGSBASE	(1u << 16)
#define CR4_OSXSAVE	(1u << 18)
#define FLAGS_ARITH	0x8d5ull	/* CF PF AF ZF SF OF */
#define AREA		4096

/* One result set per ring: [0] ring 0, [1] ring 3. */
static u64 val[2][16];
static u8 area[2][AREA] __attribute__((aligned(64)));
static u8 source[AREA] __attribute__((aligned(64)));
static u64 xcr0, avx;
static const u64 inputs[] = { 0, 1, 0x8000000000000000ull, 0xf0f0, ~0ull, 0x10 };

static void xsetbv(u32 index, u64 value)
{
	__asm__ volatile("xsetbv" :: "c"(index), "a"((u32)value), "d"((u32)(value >> 32)));
}

static void check(const char *name, const void *r0, const void *r3, size_t len)
{
	if (memcmp(r0, r3, len) != 0) {
		const u8 *a = r0, *b = r3;
		size_t i = 0;
		while (a[i] == b[i])
			i++;
		fail("complete: %s: ring 0 and ring 3 differ at byte %lu (%02x vs %02x)",
		     name, i, a[i], b[i]);
	}
	printf("complete: %s ok\n", name);
}

/* Runs fn in ring 0 (result slot 0) and natively in ring 3 (slot 1), compares `len`
 * bytes of the value slots. */
static u64 in_ring3(u64 fn)
{
	return ((u64 (*)(u64))fn)(1);
}

static void both(const char *name, u64 (*fn)(u64), size_t len)
{
	ring0_call(fn, 0);
	enter_ring3(in_ring3, (u64)fn);
	check(name, val[0], val[1], len);
}

static u64 t_x87(u64 r)
{
	u16 cw = 0x027f, sw = 0xffff, cw2 = 0;
	__asm__ volatile("fldcw %0" :: "m"(cw));
	__asm__ volatile("fnstcw %0" : "=m"(cw2));
	__asm__ volatile("fninit; fwait; fnstcw %0; fnstsw %1; fnclex" : "=m"(cw), "=m"(sw));
	val[r][0] = cw;
	val[r][1] = sw;
	val[r][2] = cw2;
	return 0;
}

#define BITOP(insn, i, r)						\
	do {								\
		u64 out, f;						\
		__asm__ volatile(insn " %2, %0; pushfq; pop %1"		\
				 : "=r"(out), "=r"(f) : "rm"(inputs[i]) : "cc"); \
		val[r][n++] = out ^ ((f & FLAGS_ARITH) << 48);		\
	} while (0)

static u64 t_popcnt(u64 r)
{
	unsigned n = 0;
	for (unsigned i = 0; i < sizeof(inputs) / sizeof(inputs[0]); i++)
		BITOP("popcnt", i, r);
	return 0;
}

static u64 t_lzcnt_tzcnt(u64 r)
{
	unsigned n = 0;
	for (unsigned i = 0; i < sizeof(inputs) / sizeof(inputs[0]); i++) {
		BITOP("lzcnt", i, r);
		BITOP("tzcnt", i, r);
	}
	return 0;
}

static u64 t_cmpxchg16b(u64 r)
{
	static u64 mem[2][2] __attribute__((aligned(16)));
	u64 lo = 1, hi = 2, f;
	mem[r][0] = 1, mem[r][1] = 2;
	/* Equal: memory takes RCX:RBX. */
	__asm__ volatile("lock cmpxchg16b %0; pushfq; pop %3"
			 : "+m"(mem[r]), "+a"(lo), "+d"(hi), "=r"(f)
			 : "b"(0x33ull), "c"(0x44ull) : "cc");
	val[r][0] = mem[r][0], val[r][1] = mem[r][1], val[r][2] = f & 0x40;
	/* Different: RDX:RAX takes memory. */
	lo = 7, hi = 8;
	__asm__ volatile("lock cmpxchg16b %0; pushfq; pop %3"
			 : "+m"(mem[r]), "+a"(lo), "+d"(hi), "=r"(f)
			 : "b"(0x55ull), "c"(0x66ull) : "cc");
	val[r][3] = lo, val[r][4] = hi, val[r][5] = f & 0x40;
	val[r][6] = mem[r][0], val[r][7] = mem[r][1];
	return 0;
}

static u64 t_cmpxchg8b(u64 r)
{
	static u64 mem[2] __attribute__((aligned(8)));
	u32 lo = 0x11, hi = 0x22;
	u64 f;
	mem[r] = 0x0000002200000011ull;
	__asm__ volatile("lock cmpxchg8b %0; pushfq; pop %3"
			 : "+m"(mem[r]), "+a"(lo), "+d"(hi), "=r"(f)
			 : "b"(0x99u), "c"(0x88u) : "cc");
	val[r][0] = mem[r], val[r][1] = f & 0x40;
	lo = 1, hi = 2;
	__asm__ volatile("lock cmpxchg8b %0; pushfq; pop %3"
			 : "+m"(mem[r]), "+a"(lo), "+d"(hi), "=r"(f)
			 : "b"(0x99u), "c"(0x88u) : "cc");
	val[r][2] = lo, val[r][3] = hi, val[r][4] = f & 0x40;
	return 0;
}

static u64 t_rdrand(u64 r)
{
	u64 a, b, fa, fb;
	__asm__ volatile("rdrand %0; pushfq; pop %1" : "=r"(a), "=r"(fa) :: "cc");
	__asm__ volatile("rdrand %0; pushfq; pop %1" : "=r"(b), "=r"(fb) :: "cc");
	/* Values differ by nature; the flags and that two draws differ are compared. */
	val[r][0] = (fa & 1) + (fb & 1);
	val[r][1] = a != b;
	return 0;
}

static u64 t_rdseed(u64 r)
{
	u64 a, fa;
	/* RDSEED may fail (CF=0) on real hardware under load: retry a few times. */
	for (int i = 0; i < 16; i++) {
		__asm__ volatile("rdseed %0; pushfq; pop %1" : "=r"(a), "=r"(fa) :: "cc");
		if (fa & 1)
			break;
	}
	val[r][0] = fa & 1;
	return 0;
}

static u64 t_rdpid(u64 r)
{
	u64 id;
	__asm__ volatile("rdpid %0" : "=r"(id));
	val[r][0] = id;
	return 0;
}

/* STAC and CLAC set and clear RFLAGS.AC (ring 0 only: no ring-3 counterpart). */
static u64 t_stac_clac(u64 r)
{
	(void)r;
	u64 after_stac, after_clac;
	__asm__ volatile("stac; pushfq; pop %0; clac; pushfq; pop %1"
			 : "=r"(after_stac), "=r"(after_clac) :: "cc");
	return ((after_stac >> 18) & 1) | (((after_clac >> 18) & 1) << 1);
}

static u64 t_fsgsbase(u64 r)
{
	u64 old, got;
	__asm__ volatile("rdfsbase %0" : "=r"(old));
	__asm__ volatile("wrfsbase %0" :: "r"(0x123456789000ull));
	__asm__ volatile("rdfsbase %0" : "=r"(got));
	__asm__ volatile("wrfsbase %0" :: "r"(old));
	val[r][0] = got;
	return 0;
}

static u64 t_xgetbv(u64 r)
{
	u32 lo, hi;
	__asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
	val[r][0] = ((u64)hi << 32) | lo;
	return 0;
}

/* The XMM (and YMM) registers take a pattern that depends on `seed`. */
static void load_vector_regs(u8 seed)
{
	/* A control word other than FNINIT's keeps x87 state in use, so processors that
	 * track it (XINUSE) save the x87 part in every format. */
	u16 cw = 0x027f;
	__asm__ volatile("fldcw %0" :: "m"(cw));
	u8 pat[32] __attribute__((aligned(32)));
	for (int i = 0; i < 32; i++)
		pat[i] = seed + i * 7;
	__asm__ volatile("movdqu %0, %%xmm0; movdqu %0, %%xmm7; movdqu %0, %%xmm15"
			 :: "m"(*(u8(*)[16])pat));	/* the kit's C uses no vector registers */
	if (avx)
		__asm__ volatile("vmovdqu %0, %%ymm3" :: "m"(pat));
}

static u64 r3_load(u64 seed)
{
	load_vector_regs((u8)seed);
	return 0;
}

static u64 t_xsave(u64 r)
{
	memset(area[r], 0, AREA);
	__asm__ volatile("xsave %0" : "+m"(*(u8(*)[AREA])area[r]) : "a"((u32)xcr0), "d"((u32)(xcr0 >> 32)));
	return 0;
}

static u64 t_xsavec(u64 r)
{
	memset(area[r], 0, AREA);
	__asm__ volatile("xsavec %0" : "+m"(*(u8(*)[AREA])area[r]) : "a"((u32)xcr0), "d"((u32)(xcr0 >> 32)));
	return 0;
}

static u64 t_xsaves(u64 r)
{
	memset(area[r], 0, AREA);
	__asm__ volatile("xsaves %0" : "+m"(*(u8(*)[AREA])area[r]) : "a"((u32)xcr0), "d"((u32)(xcr0 >> 32)));
	return 0;
}

static u64 t_xrstor(u64 r)
{
	(void)r;
	__asm__ volatile("xrstor %0" :: "m"(*(u8(*)[AREA])source), "a"((u32)xcr0), "d"((u32)(xcr0 >> 32)));
	return 0;
}

static u64 t_xrstors(u64 r)
{
	(void)r;
	__asm__ volatile("xrstors %0" :: "m"(*(u8(*)[AREA])source), "a"((u32)xcr0), "d"((u32)(xcr0 >> 32)));
	return 0;
}

static u64 t_fxsave(u64 r)
{
	memset(area[r], 0, AREA);
	__asm__ volatile("fxsave64 %0" : "=m"(*(u8(*)[512])area[r]));
	return 0;
}

static u64 t_fxrstor(u64 r)
{
	(void)r;
	__asm__ volatile("fxrstor64 %0" :: "m"(*(u8(*)[512])source));
	return 0;
}

/* Saves in ring 0 and in ring 3 with the same register contents; compares the areas
 * (the x87 instruction and data pointers excepted: nothing here sets them). */
static void compare_save(const char *name, u64 (*r0)(u64), u64 (*r3)(u64), size_t len)
{
	enter_ring3(r3_load, 0x40);
	ring0_call(r0, 0);
	enter_ring3(in_ring3, (u64)r3);
	memset(area[0] + 8, 0, 16);
	memset(area[1] + 8, 0, 16);
	check(name, area[0], area[1], len);
}

/* Restores in ring 0 from an area saved natively with other register contents; the
 * registers saved again natively must equal that area. */
static void compare_restore(const char *name, u64 (*save)(u64), u64 (*restore)(u64), size_t len)
{
	enter_ring3(r3_load, 0x90);
	enter_ring3(in_ring3, (u64)save);	/* area[1]: the state to restore */
	memcpy(source, area[1], AREA);
	enter_ring3(r3_load, 0x10);
	ring0_call(restore, 0);
	enter_ring3(in_ring3, (u64)save);	/* area[1]: what the registers hold now */
	memset(source + 8, 0, 16);
	memset(area[1] + 8, 0, 16);
	check(name, source, area[1], len);
}

static u64 saw_int3;

static void on_breakpoint(struct frame *f)
{
	saw_int3 = f->rip;
}

static u64 t_int3(u64 r)
{
	(void)r;
	u64 after;
	__asm__ volatile("int3\n1: lea 1b(%%rip), %0" : "=r"(after));
	return after;
}

static void setup_fpu(void)
{
	write_cr0((read_cr0() & ~(u64)(CR0_EM | CR0_TS)) | CR0_NE);
	write_cr4(read_cr4() | CR4_OSFXSR | CR4_OSXMMEXCPT | CR4_OSXSAVE | CR4_FSGSBASE);
	xcr0 = 3 | (cpuid(0xd, 0).eax & 4);	/* x87, SSE, and AVX when the vCPU has it */
	avx = xcr0 & 4;
	xsetbv(0, xcr0);
	printf("complete: XCR0 %#lx\n", xcr0);
}

static u64 t_unknown(u64 r)
{
	(void)r;
	__asm__ volatile("aesenc %xmm1, %xmm0");
	return 0;
}

void guest_main(void)
{
	u32 c = cpuid(1, 0).ecx, ext_c = cpuid(0x80000001, 0).ecx, l7b = cpuid(7, 0).ebx;
	setup_fpu();
	if (cmdline_uint("unknown", 0)) {
		ring0_call(t_unknown, 0);
		pass();
	}

	set_handler(3, on_breakpoint);
	u64 after = ring0_call(t_int3, 0);
	if (saw_int3 != after)	/* the handler sees RIP past INT3 */
		fail("complete: int3: #BP handler saw RIP %#lx, expected %#lx", saw_int3, after);
	printf("complete: int3 ok\n");

	both("fninit fnstcw fnstsw fwait fldcw fnclex", t_x87, 3 * 8);
	if (c & (1 << 23))
		both("popcnt", t_popcnt, 6 * 8);
	if ((ext_c & (1 << 5)) && (l7b & (1 << 3)))
		both("lzcnt tzcnt", t_lzcnt_tzcnt, 12 * 8);
	if (c & (1 << 13))
		both("cmpxchg16b", t_cmpxchg16b, 8 * 8);
	both("cmpxchg8b", t_cmpxchg8b, 5 * 8);
	if (c & (1 << 30))
		both("rdrand", t_rdrand, 2 * 8);
	if (l7b & 1)
		both("rdfsbase wrfsbase", t_fsgsbase, 8);
	if (l7b & (1 << 18))
		both("rdseed", t_rdseed, 8);
	if (cpuid(7, 0).ecx & (1 << 22))
		both("rdpid", t_rdpid, 8);
	if (l7b & (1 << 20)) {
		u64 ac = ring0_call(t_stac_clac, 0);
		if (ac != 1)
			fail("complete: stac/clac: AC after STAC %lu, after CLAC %lu", ac & 1, ac >> 1);
		printf("complete: stac clac ok\n");
	}
	/* Ring 3 may run with the host's XCR0 on PVM hosts: ring 0 is checked against the
	 * value it set, and every save and restore below names its components explicitly. */
	ring0_call(t_xgetbv, 0);
	if (val[0][0] != xcr0)
		fail("complete: xgetbv: ring 0 read %#lx, XCR0 is %#lx", val[0][0], xcr0);
	printf("complete: xgetbv ok\n");

	size_t std_len = avx ? 576 + 256 : 576, compact_len = std_len;
	compare_save("fxsave64", t_fxsave, t_fxsave, 416);
	compare_restore("fxrstor64", t_fxsave, t_fxrstor, 416);
	compare_save("xsave", t_xsave, t_xsave, std_len);
	compare_restore("xrstor", t_xsave, t_xrstor, std_len);
	u32 a = cpuid(0xd, 1).eax;
	if (a & 2) {
		compare_save("xsavec", t_xsavec, t_xsavec, compact_len);
		compare_restore("xrstor (compacted)", t_xsavec, t_xrstor, compact_len);
	}
	if (a & 8) {
		compare_save("xsaves", t_xsaves, t_xsavec, compact_len);
		compare_restore("xrstors", t_xsavec, t_xrstors, compact_len);
	}
	pass();
}
