/*
 * hello: banner, boot protocol and command line, then an i8042 reset.
 * Expected: the VM resets (VMM status 0).  If it does not, FAIL and code 2.
 */
#include "kit.h"

void guest_main(void)
{
	u64 mib = (ram_bytes() + (1 << 19)) >> 20;	/* nearest MiB */

	printf("ferrovm hello: %u vCPU(s), %lu MiB RAM\n", cpu_count(), mib);
	printf("boot: %s\n", boot_protocol_name());
	printf("cmdline: %s\n", cmdline());
	i8042_reset();
	fail_code(2, "i8042 reset did not happen");
}
