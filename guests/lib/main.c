/* First C code: set up the kit, run the guest. */
#include "kit.h"

void serial_init(void);
void cpu_init(void);
void boot_info_init(void);
NORETURN void kit_main(void);

NORETURN void kit_main(void)
{
	serial_init();
	cpu_init();
	boot_info_init();
	guest_main();
	pass();
}

NORETURN void run_ring3_device_guest(ring3_fn_t fn)
{
	tsc_hz();
	lapic_enable();
	lapic_mask_lint0();
	pic_disable();
	enter_ring3_irq(fn, 0, true);
	pass();
}
