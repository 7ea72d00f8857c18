/*
 * irq-starvation: a timer interrupting as fast as the machine allows must
 * not starve other lines on the same CPU.
 *
 * PIT channel 0 runs in mode 2 with divisor 2 (`divisor=`; 596 kHz asked;
 * the VMM clamps it: KVM's in-kernel PIT to 200 us, ferrovm's to 100 us;
 * QEMU's does not, use e.g. divisor=1193 there), the RTC interrupts
 * periodically at 1024 Hz (rs 6) and COM1's line (IRQ 4) is raised over
 * and over by the guest itself (16550 THR-empty interrupt, one edge per
 * raise, the next as soon as the previous one was taken but at most one per
 * `gap_us=` (default 500) us, so that COM1 cannot take the whole CPU from
 * the timer below it, nor the raiser's port writes hog the VMM), all taken
 * by the BSP, for a fixed TSC interval (`ms=`, default 200; longer on a
 * loaded host, up to 5 s, until 20 COM1 raises, 20 RTC interrupts and a PIT
 * interrupt were seen) in each of two phases:
 *
 *   ioapic: PIT -> pin 2 (vector 0x30), COM1 -> pin 4 (0x44), RTC -> pin 8
 *           (0x58), edge triggered, fixed delivery to the BSP;
 *   pic:    8259s at 0x20/0x28: IRQ 0 (0x20), IRQ 4 (0x24), IRQ 8 (0x28)
 *           through the cascade; OCW2 "set priority" makes IR0 the lowest;
 *           specific EOIs (slave, then master for IRQ 8).
 *
 * The timer has the lowest priority in both phases (lowest vector, lowest
 * 8259 input).  At the rates VMMs allow, a timer taken at ~100 us per
 * interrupt can keep a CPU busy all the time; with the usual priorities
 * (IRQ 0 highest) the controllers would then legitimately serve nothing
 * else.  With the timer lowest, a pending COM1 or RTC interrupt always wins
 * the next delivery, so whatever starves them is the VMM's doing (serving
 * only the lowest pending IRQ, losing an edge, an injection path that only
 * ever acknowledges the timer, ...).
 *
 * Every raise must be delivered:
 *   - COM1: one raise at a time; raised == delivered at the end, and while
 *     a raise waits the BSP may take at most `max_others=` (default 500)
 *     PIT interrupts (a lost or starved raise: unbounded; 1 s time-out,
 *     which prints the BSP's LAPIC state);
 *   - RTC: the handler reads register C, which drops IRQ 8 and lets the
 *     next period raise it again.  Every delivery must find PF set (no
 *     duplicates), and between two RTC deliveries (and after the last one)
 *     the BSP may take at most `max_others=` other interrupts: a starved or
 *     lost RTC edge leaves IRQF set and stops the RTC for good while the PIT
 *     and COM1 go on.  At 5-10 kHz of PIT that is a 50-100 ms stall; a
 *     healthy run shows about 10-20 per RTC period.  These counts, unlike
 *     rates, do not suffer when the host deschedules the vCPU (the RTC then
 *     folds periods, as the real chip does when its flags are read late);
 *     the rates are printed for information.
 * A PIT interrupt from the I/O APIC phase that arrives after it (a loaded
 * host) is counted as late and reported, not as a stray vector.
 *
 * `timer_top` keeps the usual priorities instead (PIT vector 0x60 above
 * the others, IR0 the 8259's highest), to see what a saturating timer does.
 *
 * The raiser is CPU 1 (from ring 3) with more than one CPU, else the BSP
 * itself from ring 3 with interrupts on; an idle BSP waits in "sti; hlt".
 */
#include "kit.h"

#define V_PIT_LOW	0x30
#define V_PIT_TOP	0x60	/* `timer_top` */
#define V_COM1_IOAPIC	0x44
#define V_RTC_IOAPIC	0x58
#define V_WAKE		0xf0
#define PIC_BASE_M	0x20
#define PIC_BASE_S	0x28
#define RTC_RS		6		/* 1024 Hz */
#define COM1_IER	(SERIAL_PORT + 1)
#define COM1_IIR	(SERIAL_PORT + 2)

static volatile u32 pit_n, rtc_n, rtc_empty, com1_n, stray, stray_vec, spurious;
static volatile u32 others_since_rtc, max_others_rtc;	/* PIT + COM1 between RTC deliveries */
static volatile u32 pit_while_com1, max_pit_while_com1;	/* PIT while a COM1 raise waits */
static volatile u32 raised, armed, raise_timeout, running, raiser_done;
static volatile u64 t_start, t_end, t_cap;
static volatile u32 late;		/* the I/O APIC phase's PIT vector, after it */
static volatile u64 empty_at;		/* the first RTC delivery without PF */
static volatile u32 empty_c, empty_n;
#define MIN_EACH	20		/* COM1 raises and RTC interrupts per phase, at least */
static bool pic_phase;
static unsigned ncpu;
static u64 interval_ms, raise_gap_us;
static u16 pit_divisor;
static u8 v_pit = V_PIT_LOW;
static bool timer_top;

static void eoi(unsigned irq)
{
	if (pic_phase)
		pic_eoi(irq);
	else
		lapic_eoi();
}

static void handler(struct frame *f)
{
	unsigned v = (unsigned)f->vector;
	if (pic_phase && v == v_pit) {
		late++;			/* raised before the I/O APIC phase ended */
		lapic_eoi();
	} else if ((!pic_phase && v == v_pit) || (pic_phase && v == PIC_BASE_M + ISA_IRQ_PIT)) {
		pit_n++;
		others_since_rtc++;
		if (armed > com1_n && ++pit_while_com1 > max_pit_while_com1)
			max_pit_while_com1 = pit_while_com1;
		eoi(ISA_IRQ_PIT);
	} else if (v == V_RTC_IOAPIC || v == PIC_BASE_S + ISA_IRQ_RTC - 8) {
		u8 c = rtc_ack();		/* drops IRQ 8 */
		if (c & RTC_C_PF)
			rtc_n++;
		else if (!rtc_empty++)
			empty_at = rdtsc(), empty_c = c, empty_n = rtc_n;
		if (others_since_rtc > max_others_rtc)
			max_others_rtc = others_since_rtc;
		others_since_rtc = 0;
		eoi(ISA_IRQ_RTC);
	} else if (v == V_COM1_IOAPIC || v == PIC_BASE_M + ISA_IRQ_COM1) {
		com1_n++;
		others_since_rtc++;
		pit_while_com1 = 0;
		eoi(ISA_IRQ_COM1);
	} else if (v == PIC_BASE_M + 7 || v == PIC_BASE_S + 7) {
		spurious++;		/* 8259 spurious IRQ 7 / 15: no EOI to that chip */
		if (v == PIC_BASE_S + 7)
			pic_eoi(PIC_CASCADE_IRQ);
	} else {
		stray++;
		stray_vec = v;
		lapic_eoi();
	}
}

/* One edge on IRQ 4 (acknowledge, then enable the THR-empty interrupt). */
static void com1_raise(void)
{
	outb(COM1_IER, 0);
	(void)inb(COM1_IIR);
	outb(COM1_IER, 0x02);
	outb(COM1_IER, 0);
}

/* Ring 3: raise COM1 one edge at a time for the interval. */
static u64 raiser(u64 unused)
{
	(void)unused;
	u64 hz = tsc_hz();
	u64 gap = raise_gap_us * (hz / 1000000);
	while (!running)
		pause();
	u64 next = rdtsc();
	for (;;) {
		u64 now = rdtsc();
		bool enough = com1_n >= MIN_EACH && rtc_n >= MIN_EACH && pit_n > 0;
		if ((s64)(now - t_cap) >= 0 || ((s64)(now - t_end) >= 0 && enough))
			break;
		while ((s64)(rdtsc() - next) < 0)
			pause();
		next = rdtsc() + gap;
		u32 want = raised + 1;
		raised = want;			/* before the edge: the handler may run at once */
		com1_raise();
		armed = want;			/* the edge is out: PIT interrupts now count */
		u64 limit = rdtsc() + hz;	/* 1 s */
		while (com1_n < want && (s64)(rdtsc() - limit) < 0)
			pause();
		if (com1_n < want) {
			raise_timeout = want;
			break;
		}
	}
	raiser_done = 1;
	return 0;
}

static volatile u32 ap_go;

static void ap_main(unsigned idx)
{
	for (;;) {
		while (!(idx == 1 && ap_go)) {
			sti();
			hlt();
			cli();
		}
		ap_go = 0;
		enter_ring3(raiser, 0);
	}
}

static void wake_handler(struct frame *f)
{
	(void)f;
	lapic_eoi();
}

static void run_phase(const char *name)
{
	pit_n = rtc_n = rtc_empty = com1_n = stray = spurious = late = 0;
	others_since_rtc = max_others_rtc = pit_while_com1 = max_pit_while_com1 = 0;
	raised = armed = raise_timeout = raiser_done = running = 0;
	u64 hz = tsc_hz();
	(void)rtc_ack();
	if (pic_phase) {
		pic_unmask_irq(ISA_IRQ_PIT);
		pic_unmask_irq(ISA_IRQ_COM1);
		pic_unmask_irq(ISA_IRQ_RTC);
	} else {
		u8 me = (u8)lapic_id();
		ioapic_route(IOAPIC_PIN_PIT, v_pit, me, 0);
		ioapic_route(ISA_IRQ_RTC, V_RTC_IOAPIC, me, 0);
		ioapic_route(ISA_IRQ_COM1, V_COM1_IOAPIC, me, 0);
	}
	pit_periodic(pit_divisor);
	rtc_periodic(RTC_RS);
	t_start = rdtsc();
	t_end = t_start + interval_ms * hz / 1000;
	t_cap = t_start + 5 * hz;	/* a loaded host: go on until MIN_EACH of each */
	running = 1;
	if (ncpu > 1) {
		ap_go = 1;
		lapic_send_ipi(cpu_apic_id(1), V_WAKE);
		/* Idle, interrupts on, until the raiser is done. */
		while (!raiser_done) {
			lapic_timer_oneshot(V_WAKE, 1000000, LAPIC_DIV_1);	/* 1 ms */
			__asm__ volatile("sti; hlt; cli" ::: "memory");
		}
		lapic_timer_stop();
	} else {
		enter_ring3_irq(raiser, 0, true);
	}
	u64 t1 = rdtsc();
	u32 trailing = others_since_rtc;	/* after the last RTC delivery */
	/* Stop the sources, then let what is in flight arrive.  PIE off drops
	 * IRQ 8 but keeps PF, so an RTC interrupt already on its way still
	 * finds its flag. */
	pit_stop();
	rtc_write(RTC_REG_B, rtc_read(RTC_REG_B) & ~RTC_B_PIE);
	u64 drain = rdtsc() + 2 * hz / 1000;	/* 2 ms, halted: see README on late delivery */
	while ((s64)(rdtsc() - drain) < 0) {
		lapic_timer_oneshot(V_WAKE, 500000, LAPIC_DIV_1);
		__asm__ volatile("sti; hlt; cli" ::: "memory");
	}
	lapic_timer_stop();
	u64 ms_x10 = (t1 - t_start) * 10000 / hz;
	u32 pit_c = pit_n, rtc_c = rtc_n, com1_c = com1_n;
	if (pic_phase) {
		pic_disable();
	} else {
		ioapic_mask(IOAPIC_PIN_PIT);
		ioapic_mask(ISA_IRQ_RTC);
		ioapic_mask(ISA_IRQ_COM1);
	}
	(void)rtc_ack();
	u32 worst_rtc = max_others_rtc > trailing ? max_others_rtc : trailing;

	u64 us = ms_x10 * 100;
	printf("irq-starvation: %-6s %lu.%lu ms: PIT %u (%llu Hz), RTC %u (%llu Hz, %lu periods), "
	       "COM1 %u of %u raises; other IRQs between RTC IRQs <= %u, PIT IRQs while COM1 waits <= %u\n",
	       name, ms_x10 / 10, ms_x10 % 10, pit_c, us ? pit_c * 1000000ull / us : 0, rtc_c,
	       us ? rtc_c * 1000000ull / us : 0, us * RTC_RATE_HZ(RTC_RS) / 1000000, com1_c, raised,
	       worst_rtc, max_pit_while_com1);
	u32 max_others = (u32)cmdline_uint("max_others", 500);
	if (stray)
		fail("%s: %u interrupts on unexpected vectors (last 0x%02x)", name, stray, stray_vec);
	if (spurious)
		printf("irq-starvation: %s: %u spurious 8259 interrupts (IRQ 7/15)\n", name, spurious);
	if (raise_timeout) {
		console_lock();
		printf("irq-starvation: BSP LAPIC: TPR 0x%02x PPR 0x%02x ISR", lapic_read(LAPIC_TPR),
		       lapic_read(LAPIC_PPR));
		for (unsigned i = 0; i < 8; i++)
			printf(" %08x", lapic_read(LAPIC_ISR + 0x10 * i));
		printf(" IRR");
		for (unsigned i = 0; i < 8; i++)
			printf(" %08x", lapic_read(LAPIC_IRR + 0x10 * i));
		printf("; COM1 IIR 0x%02x; I/O APIC pin 4 0x%lx pin 2 0x%lx\n", inb(COM1_IIR),
		       ioapic_get_entry(ISA_IRQ_COM1), ioapic_get_entry(IOAPIC_PIN_PIT));
		console_unlock();
		fail("%s: COM1 raise #%u not delivered within 1 s (%u PIT interrupts taken meanwhile)",
		     name, raise_timeout, pit_while_com1);
	}
	if (late)
		printf("irq-starvation: %s: %u late interrupts from the I/O APIC phase's PIT\n", name, late);
	if (com1_c != raised || raised < MIN_EACH)
		fail("%s: COM1 raised %u times (want %u at least), delivered %u", name, raised, MIN_EACH,
		     com1_c);
	if (max_pit_while_com1 > max_others)
		fail("%s: %u PIT interrupts taken while a COM1 raise was pending (max %u): IRQ 4 starved",
		     name, max_pit_while_com1, max_others);
	if (pit_c == 0)
		fail("%s: no PIT interrupt", name);
	if (rtc_empty)
		fail("%s: %u RTC deliveries found register C without PF (duplicates; the first: C 0x%02x "
		     "after %u good ones, %lu us into the phase)", name, rtc_empty, empty_c, empty_n,
		     (empty_at - t_start) * 1000000 / tsc_hz());
	if (rtc_c < MIN_EACH || worst_rtc > max_others)
		fail("%s: %u other interrupts taken without an RTC interrupt in between (max %u; RTC %u): "
		     "IRQ 8 starved or its edge lost", name, worst_rtc, max_others, rtc_c);
}

void guest_main(void)
{
	interval_ms = cmdline_uint("ms", 200);
	raise_gap_us = cmdline_uint("gap_us", 500);
	pit_divisor = (u16)cmdline_uint("divisor", 2);
	timer_top = cmdline_arg("timer_top", NULL) != NULL;
	if (timer_top)
		v_pit = V_PIT_TOP;
	ncpu = cpu_count();
	if (ncpu > KIT_MAX_CPUS)
		ncpu = KIT_MAX_CPUS;
	for (unsigned v = 0x20; v < 0xff; v++)
		set_handler(v, handler);
	set_handler(V_WAKE, wake_handler);
	lapic_enable();
	lapic_mask_lint0();
	pic_disable();
	outb(COM1_IER, 0);
	ioapic_mask_all();
	rtc_periodic_stop();
	tsc_hz();
	if (!rtc_present())
		fail("no RTC at ports 0x70/0x71 (register D = 0x%02x)", rtc_read(RTC_REG_D));
	unsigned aps = smp_start_aps(ap_main);
	if (aps != ncpu - 1)
		fail("%u of %u APs started", aps, ncpu - 1);
	printf("irq-starvation: PIT divisor %u (%lu Hz asked, %s priority), RTC %u Hz, COM1 raised by cpu %u, all to cpu 0\n",
	       pit_divisor, pit_divisor_hz_milli(pit_divisor) / 1000, timer_top ? "top" : "lowest",
	       RTC_RATE_HZ(RTC_RS), ncpu > 1 ? 1 : 0);

	pic_phase = false;
	run_phase("ioapic");

	pic_phase = true;
	pic_init(PIC_BASE_M, PIC_BASE_S);
	if (!timer_top)
		pic_set_lowest_priority(ISA_IRQ_PIT);	/* IR1 highest ... IR0 lowest */
	lapic_write(LAPIC_LVT_LINT0, 0x700);	/* ExtINT, unmasked */
	run_phase("pic");
	lapic_mask_lint0();
	pass();
}
