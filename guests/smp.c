/*
 * smp: starts every AP (INIT-SIPI-SIPI); each enters ring 3 on its own TSS
 * and stacks, prints its index and APIC ID from there (port I/O through its
 * own I/O bitmap, console lock) and checks in; the BSP checks that all
 * cpu_count() CPUs came up with distinct APIC IDs.
 */
#include "kit.h"

static volatile u32 checked_in;
static volatile u32 seen_idx[KIT_MAX_CPUS];

static u64 ap_ring3(u64 idx)
{
	u32 id = lapic_id();
	if (cpl() != 3)
		fail("cpu %lu: not in ring 3", idx);
	printf("cpu %lu apic_id %u\n", idx, id);
	if (cpu_index() != idx)
		fail("cpu %lu: cpu_index() = %u", idx, cpu_index());
	return id;
}

static void ap_main(unsigned idx)
{
	u64 id = enter_ring3(ap_ring3, idx);
	if (id != lapic_id() || id != cpu_apic_id(idx))
		fail("cpu %u: ring 3 saw APIC ID %lu, ring 0 %u", idx, id, lapic_id());
	seen_idx[idx] = 1;
	atomic_inc(&checked_in);
}

void guest_main(void)
{
	unsigned n = cpu_count();
	u64 t0 = rdtsc();
	unsigned started = smp_start_aps(ap_main);
	u64 t1 = rdtsc();
	u64 deadline = t1 + 2 * tsc_hz();
	while (checked_in < started && (s64)(rdtsc() - deadline) < 0)
		pause();
	unsigned up = 1 + checked_in;

	console_lock();
	printf("smp: %u of %u CPUs up, apic ids:", up, n);
	for (unsigned i = 0; i < up; i++)
		printf(" %u", cpu_apic_id(i));
	printf("\n");
	console_unlock();
	printf("smp: start-up took %lu us (tsc %lu kHz)\n",
	       (t1 - t0) * 1000000 / tsc_hz(), tsc_hz() / 1000);

	if (started != n - 1 || up != n)
		fail("%u of %u CPUs up (%u APs started)", up, n, started);
	if (cpu_index() != 0)
		fail("BSP cpu_index() = %u", cpu_index());
	for (unsigned i = 1; i < n; i++)
		if (!seen_idx[i])
			fail("cpu %u did not run ap_main", i);
	for (unsigned i = 0; i < n; i++)
		for (unsigned j = i + 1; j < n; j++)
			if (cpu_apic_id(i) == cpu_apic_id(j))
				fail("cpus %u and %u share APIC ID %u", i, j, cpu_apic_id(i));
	pass();
}
