/*
 * s3-resume: ACPI S3 (suspend to RAM) and the wake-up through the FACS waking vector.
 *
 * The guest fills a RAM buffer with a pattern, copies a 16-bit waking trampoline to
 * 0x30000, points the FACS Firmware_Waking_Vector at it, arms the RTC alarm `alarm_s=2`
 * seconds ahead (seconds register only; minutes and hours "don't care"), enables RTC_EN in
 * PM1a_EN and writes SLP_TYP = the DSDT's \_S3 value with SLP_EN to PM1a_CNT.  On wake
 * the trampoline runs in real mode: it records CS, IP and CR0, reads PM1a_STS, then
 * returns to long mode on the page tables, EFER, CR4 and CR0 saved before sleeping, and
 * jumps to s3_resumed(), which checks everything and prints:
 *   s3: woke in real mode at 3000:0000, PM1_STS wak rtc, RTC_C alarm, RAM intact (64 KiB)
 * (RTC_C's AF is reported, not required: QEMU's wake-up resets the RTC's flags.)
 * Under QEMU -M pc it passes the same way; under -M q35 the ICH9's PM block is not
 * decoded again before the OS reprograms the LPC bridge, so PM1_STS reads 0xffff.
 * `wake=api` arms no alarm and expects the API's resume instead (WAK_STS alone).
 * `vector=x32` sets X_Firmware_Waking_Vector instead, to the trampoline's 32-bit entry,
 * which must be entered in flat protected mode, paging off ("s3: woke in 32-bit protected
 * mode"); `vector=none` sets neither (the VMM must refuse to resume).  `cycles=N` sleeps
 * N times in a row.  Any mismatch fails.
 */
#include "kit.h"

#define TRAMP_BASE	0x30000UL
#define PM1_STS		0x600
#define PM1_EN		0x602
#define PM1_CNT		0x604
#define WAK_STS		(1u << 15)
#define RTC_STS		(1u << 10)
#define SLP_EN		(1u << 13)
#define S3_SLP_TYP	1u
#define PATTERN_KIB	64

extern char s3_tramp_start[], s3_tramp_end[], s3_tramp_ip[], s3_tramp32[], t_entry32[];
extern char t_cs[], t_ip[], t_cr0[], t_pm1[], t_gdtr[], t_cr3[], t_cr4[], t_efer[],
	t_cr0_saved[], t_rsp[], t_entry[];

/*
 * The trampoline, copied to TRAMP_BASE and entered at CS:IP = 0x3000:0000.  Real-mode
 * data references are offsets from its start (DS = CS); the far jump and the 64-bit
 * code use linear addresses TRAMP_BASE + offset.
 */
__asm__(
	".section .rodata.s3tramp, \"a\"\n"
	".code16\n"
	".globl s3_tramp_start, s3_tramp_end, s3_tramp_ip, s3_tramp32, t_entry32\n"
	".globl t_cs, t_ip, t_cr0, t_pm1, t_gdtr, t_cr3, t_cr4, t_efer, t_cr0_saved, t_rsp, t_entry\n"
	"s3_tramp_start:\n"
	"	cli\n"
	"	movw %cs, %ax\n"
	"	movw %ax, %ds\n"
	"	movw %ax, t_cs - s3_tramp_start\n"
	"	smsw %ax\n"
	"	movw %ax, t_cr0 - s3_tramp_start\n"
	"	call 1f\n"
	"s3_tramp_ip:\n"
	"1:	popw %ax\n"
	"	movw %ax, t_ip - s3_tramp_start\n"
	"	movw $0x600, %dx\n"
	"	inw %dx, %ax\n"
	"	movw %ax, t_pm1 - s3_tramp_start\n"
	"	lgdtl t_gdtr - s3_tramp_start\n"
	"	movl t_cr4 - s3_tramp_start, %eax\n"
	"	movl %eax, %cr4\n"
	"	movl t_cr3 - s3_tramp_start, %eax\n"
	"	movl %eax, %cr3\n"
	"	movl $0xc0000080, %ecx\n"
	"	movl t_efer - s3_tramp_start, %eax\n"
	"	xorl %edx, %edx\n"
	"	wrmsr\n"
	"	movl t_cr0_saved - s3_tramp_start, %eax\n"
	"	movl %eax, %cr0\n"
	"	ljmpl $0x08, $(0x30000 + 2f - s3_tramp_start)\n"
	/* X_Firmware_Waking_Vector entry: flat 32-bit protected mode, no GDT of ours yet. */
	".code32\n"
	"s3_tramp32:\n"
	"	cli\n"
	"	lgdtl 0x30000 + t_gdtr - s3_tramp_start\n"
	"	movl %cr0, %eax\n"
	"	movw %ax, 0x30000 + t_cr0 - s3_tramp_start\n"
	"	movw $1, 0x30000 + t_entry32 - s3_tramp_start\n"
	"	movw $0x600, %dx\n"
	"	inw %dx, %ax\n"
	"	movw %ax, 0x30000 + t_pm1 - s3_tramp_start\n"
	"	movl 0x30000 + t_cr4 - s3_tramp_start, %eax\n"
	"	movl %eax, %cr4\n"
	"	movl 0x30000 + t_cr3 - s3_tramp_start, %eax\n"
	"	movl %eax, %cr3\n"
	"	movl $0xc0000080, %ecx\n"
	"	movl 0x30000 + t_efer - s3_tramp_start, %eax\n"
	"	xorl %edx, %edx\n"
	"	wrmsr\n"
	"	movl 0x30000 + t_cr0_saved - s3_tramp_start, %eax\n"
	"	movl %eax, %cr0\n"
	"	ljmpl $0x08, $(0x30000 + 2f - s3_tramp_start)\n"
	".code64\n"
	"2:	movw $0x10, %ax\n"
	"	movw %ax, %ds\n"
	"	movw %ax, %es\n"
	"	movw %ax, %ss\n"
	"	movq 0x30000 + t_rsp - s3_tramp_start, %rsp\n"
	"	movq 0x30000 + t_entry - s3_tramp_start, %rax\n"
	"	jmp *%rax\n"
	"	.balign 8\n"
	"3:	.quad 0\n"
	"	.quad 0x00af9a000000ffff\n"	/* 0x08: 64-bit code */
	"	.quad 0x00cf92000000ffff\n"	/* 0x10: data */
	"t_gdtr:	.word 23\n"
	"	.long 0x30000 + 3b - s3_tramp_start\n"
	"	.balign 8\n"
	"t_cr3:	.quad 0\n"
	"t_cr4:	.quad 0\n"
	"t_efer:	.quad 0\n"
	"t_cr0_saved:	.quad 0\n"
	"t_rsp:	.quad 0\n"
	"t_entry:	.quad 0\n"
	"t_cs:	.word 0xffff\n"
	"t_ip:	.word 0xffff\n"
	"t_cr0:	.word 0xffff\n"
	"t_pm1:	.word 0\n"
	"t_entry32:	.word 0\n"
	"s3_tramp_end:\n"
	".code64\n"
	".previous\n");

/* The copy's field at the same offset as `sym` in the original. */
#define TFIELD(type, sym) (*(volatile type *)(TRAMP_BASE + ((char *)(sym) - s3_tramp_start)))

static u8 resume_stack[16384] __attribute__((aligned(16)));
static struct {
	u16 limit;
	u64 base;
} __attribute__((packed)) saved_gdtr, saved_idtr;
static u16 saved_cs;
static u64 *pattern;
static u64 pattern_seed;
static bool rtc_wake;		/* false: wake=api */
enum vector_kind { V_REAL, V_X32, V_NONE };
static enum vector_kind vector_kind;	/* vector=real (default), x32 or none */

static u64 next(u64 *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x;
}

static void fill_pattern(void)
{
	size_t words = PATTERN_KIB * 1024UL / 8;
	pattern = dma_alloc(words * 8, 4096);
	u64 x = pattern_seed = rdtsc() | 1;
	for (size_t i = 0; i < words; i++)
		pattern[i] = next(&x);
}

static bool pattern_intact(void)
{
	size_t words = PATTERN_KIB * 1024UL / 8;
	u64 x = pattern_seed;
	for (size_t i = 0; i < words; i++)
		if (pattern[i] != next(&x))
			return false;
	return true;
}

static u8 to_rtc(u8 v, bool bcd) { return bcd ? (u8)((v / 10) << 4 | v % 10) : v; }
static u8 from_rtc(u8 v, bool bcd) { return bcd ? (u8)((v >> 4) * 10 + (v & 15)) : v; }

/* The alarm `secs` ahead, matching on the seconds register only. */
static void arm_alarm(unsigned secs)
{
	bool bcd = !(rtc_read(RTC_REG_B) & 0x04);
	u8 now = from_rtc(rtc_read(0x00), bcd);
	rtc_write(0x01, to_rtc((u8)((now + secs) % 60), bcd));
	rtc_write(0x03, 0xff);
	rtc_write(0x05, 0xff);
	rtc_read(RTC_REG_C);
	rtc_write(RTC_REG_B, rtc_read(RTC_REG_B) | 0x20);	/* AIE */
}

static void install_trampoline(void)
{
	memcpy((void *)TRAMP_BASE, s3_tramp_start, (size_t)(s3_tramp_end - s3_tramp_start));
	void s3_resumed(void);
	TFIELD(u64, t_cr3) = read_cr3();
	TFIELD(u64, t_cr4) = read_cr4() & ~(1UL << 17);	/* no PCIDE outside long mode */
	TFIELD(u64, t_efer) = rdmsr(0xc0000080) & ~(1UL << 10);	/* LMA is the CPU's */
	TFIELD(u64, t_cr0_saved) = read_cr0();
	TFIELD(u64, t_rsp) = (u64)(resume_stack + sizeof(resume_stack));
	TFIELD(u64, t_entry) = (u64)s3_resumed;
	__asm__ volatile("sgdt %0; sidt %1" : "=m"(saved_gdtr), "=m"(saved_idtr));
	saved_cs = read_cs();
}

static void set_waking_vector(void)
{
	const u8 *fadt = (const u8 *)acpi_find_table("FACP");
	if (!fadt)
		fail("no FADT");
	/* X_FIRMWARE_CTRL only in a FADT long enough to have it (revision 1 has 116 bytes). */
	u32 fadt_len = ((const struct acpi_sdt_header *)fadt)->length;
	u64 facs = fadt_len >= 140 ? *(const u64 *)(fadt + 132) : 0;
	if (!facs)
		facs = *(const u32 *)(fadt + 36);
	if (memcmp((const void *)facs, "FACS", 4))
		fail("no FACS at 0x%lx", facs);
	u64 x32 = TRAMP_BASE + (u64)(s3_tramp32 - s3_tramp_start);
	*(volatile u32 *)(facs + 12) = vector_kind == V_REAL ? (u32)TRAMP_BASE : 0;
	*(volatile u64 *)(facs + 24) = vector_kind == V_X32 ? x32 : 0;
	printf("s3: FACS at 0x%lx, waking vector %s 0x%lx\n", facs,
	       vector_kind == V_X32 ? "(X_, 32-bit)" : "(real mode)",
	       vector_kind == V_REAL ? TRAMP_BASE : vector_kind == V_X32 ? x32 : 0);
}

static unsigned cycles, done;	/* cycles=N: sleep N times (default 1) */

/* Clears PM1 status and the trampoline's records, arms the wake event, sleeps. */
static NORETURN void enter_s3(void)
{
	TFIELD(u16, t_cs) = 0xffff;
	TFIELD(u16, t_ip) = 0xffff;
	TFIELD(u16, t_cr0) = 0xffff;
	TFIELD(u16, t_pm1) = 0;
	TFIELD(u16, t_entry32) = 0;
	outw(PM1_STS, 0xffff);
	if (rtc_wake) {
		arm_alarm((unsigned)cmdline_uint("alarm_s", 2));
		outw(PM1_EN, inw(PM1_EN) | RTC_STS);
	}
	printf("s3: %u KiB pattern written, entering S3 (wake: %s)\n", PATTERN_KIB,
	       rtc_wake ? "RTC alarm" : "API");
	cli();
	outw(PM1_CNT, (u16)(S3_SLP_TYP << 10 | SLP_EN));
	/* Still here: the VMM did not suspend the machine. */
	tsc_delay_us(200000);
	fail("still running 200 ms after SLP_EN with SLP_TYP %u", S3_SLP_TYP);
}

void guest_main(void)
{
	cycles = (unsigned)cmdline_uint("cycles", 1);
	size_t len;
	const char *w = cmdline_arg("wake", &len);
	rtc_wake = !(w && len == 3 && !strncmp(w, "api", 3));
	const char *v = cmdline_arg("vector", &len);
	vector_kind = v && len == 3 && !strncmp(v, "x32", 3)	? V_X32
		      : v && len == 4 && !strncmp(v, "none", 4) ? V_NONE
								 : V_REAL;
	fill_pattern();
	install_trampoline();
	set_waking_vector();
	enter_s3();
}

/* Back in long mode on the trampoline's GDT: the kit's descriptor tables, then checks. */
void s3_resumed(void)
{
	__asm__ volatile("lgdt %0; lidt %1" :: "m"(saved_gdtr), "m"(saved_idtr));
	__asm__ volatile("pushq %0; leaq 1f(%%rip), %%rax; pushq %%rax; lretq; 1:"
			 :: "r"((u64)saved_cs) : "rax", "memory");
	u16 cs = TFIELD(u16, t_cs), ip = TFIELD(u16, t_ip), cr0 = TFIELD(u16, t_cr0);
	u16 pm1 = TFIELD(u16, t_pm1);
	u16 want_ip = (u16)(s3_tramp_ip - s3_tramp_start);
	u8 rtc_c = rtc_read(RTC_REG_C);
	bool intact = pattern_intact();
	bool entry32 = TFIELD(u16, t_entry32);
	if (entry32)
		printf("s3: woke in 32-bit protected mode (CR0 0x%x) at 0x%lx", cr0,
		       TRAMP_BASE + (u64)(s3_tramp32 - s3_tramp_start));
	else
		printf("s3: woke in %s mode at %04x:%04x", cr0 & 1 ? "protected" : "real", cs,
		       (u16)(ip - want_ip));
	printf(", PM1_STS%s%s, RTC_C%s, RAM %s (%u KiB)\n", pm1 & WAK_STS ? " wak" : "",
	       pm1 & RTC_STS ? " rtc" : "", rtc_c & 0x20 ? " alarm" : " no-alarm",
	       intact ? "intact" : "CHANGED", PATTERN_KIB);
	if (vector_kind == V_X32) {
		if (!entry32 || (cr0 & 0x8001) != 1)	/* PE on, PG off (bit 31 not recorded) */
			fail("X_Firmware_Waking_Vector not entered in 32-bit protected mode");
	} else if (entry32 || (cr0 & 1)) {
		fail("the waking vector was entered in protected mode");
	} else if (cs != TRAMP_BASE >> 4 || ip != want_ip) {
		fail("entered at %04x:%04x, not at %04lx:0000", cs, (u16)(ip - want_ip),
		     TRAMP_BASE >> 4);
	}
	if (!(pm1 & WAK_STS))
		fail("WAK_STS clear after the wake-up (PM1_STS 0x%x)", pm1);
	/* AF is only reported: QEMU's wake-up resets the RTC's flags, ferrovm keeps them. */
	if (rtc_wake && !(pm1 & RTC_STS))
		fail("RTC_STS clear after an RTC wake-up (PM1_STS 0x%x)", pm1);
	if (!rtc_wake && (pm1 & RTC_STS))
		fail("RTC_STS set after the API's resume (PM1_STS 0x%x)", pm1);
	if (!intact)
		fail("RAM changed across S3");
	if (++done < cycles)
		enter_s3();
	printf("s3: %u sleep(s), every wake-up checked\n", done);
	pass();
}
