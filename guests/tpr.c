/*
 * tpr: the task-priority register (CR8) holds back lower-class interrupts.
 *
 * TPR = 0x50 (class 5): a self-IPI on 0x41 (class 4) and, with more than one
 * CPU, an IPI on 0x42 from CPU 1 stay pending in IRR; 0x61 (class 6) is
 * delivered; TPR = 0x40 (equal class) still holds 0x41/0x42 back; TPR = 0
 * releases them, higher vector first.
 */
#include "kit.h"

#define V_SELF	0x41
#define V_AP	0x42
#define V_HIGH	0x61

static volatile u32 count[256];
static volatile u8 order[8];
static volatile u32 norder;
static volatile u32 ap_go, ap_sent;

static void handler(struct frame *f)
{
	count[f->vector]++;
	if (norder < ARRAY_SIZE(order))
		order[norder++] = (u8)f->vector;
	lapic_eoi();
}

static void ap_main(unsigned idx)
{
	if (idx != 1)
		return;
	while (!ap_go)
		pause();
	lapic_send_ipi(cpu_apic_id(0), V_AP);
	ap_sent = 1;
}

/* Waits up to `us` for count[v] to reach `want`. */
static bool wait_count(u8 v, u32 want, u64 us)
{
	u64 end = rdtsc() + us * (tsc_hz() / 1000000);
	while (count[v] < want && (s64)(rdtsc() - end) < 0)
		pause();
	return count[v] >= want;
}

static void expect_held(const char *when)
{
	tsc_delay_us(20000);
	if (count[V_SELF] || count[V_AP])
		fail("%s: class-4 vector delivered (0x41: %u, 0x42: %u) with TPR 0x%x",
		     when, count[V_SELF], count[V_AP], get_tpr());
	if (!lapic_vector_bit(LAPIC_IRR, V_SELF))
		fail("%s: 0x41 not pending in IRR", when);
	if (ap_sent && !lapic_vector_bit(LAPIC_IRR, V_AP))
		fail("%s: 0x42 not pending in IRR", when);
	printf("tpr: TPR 0x%02x (PPR 0x%02x): 0x41%s held back, IRR set\n", get_tpr(),
	       lapic_read(LAPIC_PPR) & 0xff, ap_sent ? " and 0x42" : "");
}

void guest_main(void)
{
	unsigned n = cpu_count();
	set_handler(V_SELF, handler);
	set_handler(V_AP, handler);
	set_handler(V_HIGH, handler);
	lapic_enable();
	lapic_mask_lint0();	/* nothing from the PIC (SeaBIOS runs the PIT) */
	tsc_hz();
	unsigned aps = smp_start_aps(ap_main);
	if (aps != n - 1)
		fail("%u of %u APs started", aps, n - 1);

	set_tpr(0x50);
	u32 mmio_tpr = lapic_read(LAPIC_TPR) & 0xff;
	if (get_tpr() != 0x50 || mmio_tpr != 0x50)
		fail("TPR: CR8 reads 0x%x, MMIO TPR 0x%x, want 0x50", get_tpr(), mmio_tpr);
	sti();

	lapic_self_ipi(V_SELF);
	if (n > 1) {
		ap_go = 1;
		u64 end = rdtsc() + tsc_hz();
		while (!ap_sent && (s64)(rdtsc() - end) < 0)
			pause();
		if (!ap_sent)
			fail("CPU 1 did not send its IPI");
	}
	expect_held("TPR 0x50");

	lapic_self_ipi(V_HIGH);
	if (!wait_count(V_HIGH, 1, 1000000))
		fail("0x61 (class 6) not delivered with TPR 0x50");
	printf("tpr: TPR 0x50: 0x61 delivered\n");
	expect_held("TPR 0x50 after 0x61");

	set_tpr(0x40);
	expect_held("TPR 0x40");

	set_tpr(0);
	bool ok = wait_count(V_SELF, 1, 1000000) && (n == 1 || wait_count(V_AP, 1, 1000000));
	tsc_delay_us(10000);
	cli();
	if (!ok)
		fail("TPR 0: 0x41 %u, 0x42 %u deliveries", count[V_SELF], count[V_AP]);
	if (count[V_SELF] != 1 || count[V_HIGH] != 1 || count[V_AP] != (n > 1))
		fail("counts: 0x41 %u, 0x42 %u, 0x61 %u", count[V_SELF], count[V_AP], count[V_HIGH]);
	if (n > 1 && !(order[1] == V_AP && order[2] == V_SELF))
		fail("TPR 0: delivered 0x%x before 0x%x, want 0x42 first", order[1], order[2]);
	printf("tpr: TPR 0: 0x41%s delivered once%s\n", n > 1 ? " and 0x42" : "",
	       n > 1 ? ", 0x42 first" : "");
	pass();
}
