/*
 * exit-code: writes the number N from the command line (e.g. "7") to the
 * debug-exit port, so the VMM exits with status (N << 1) | 1.
 */
#include "kit.h"

void guest_main(void)
{
	u64 n;

	if (!cmdline_find_uint(NULL, &n))
		fail("no exit code on the command line \"%s\"", cmdline());
	if (n > 255)
		fail("exit code %lu out of range 0-255", n);
	printf("exit-code: %lu\n", n);
	exit_vm((u8)n);
}
