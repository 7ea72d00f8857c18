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
