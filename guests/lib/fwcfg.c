/* QEMU-compatible fw_cfg over I/O ports 0x510 (selector) / 0x511 (data). */
#include "kit.h"

/*
 * The selector is one register for the whole machine: a select and the reads after it
 * must not interleave with another CPU's (APs that ask cpu_count() at once would read
 * each other's items), so every access holds this lock.
 */
static spinlock_t fw_cfg_lock = SPINLOCK_INIT;

void fw_cfg_get(u16 key, void *buf, size_t len)
{
	u8 *p = buf;
	spin_lock(&fw_cfg_lock);
	outw(FW_CFG_PORT_SEL, key);
	while (len--)
		*p++ = inb(FW_CFG_PORT_DATA);
	spin_unlock(&fw_cfg_lock);
}

bool fw_cfg_present(void)
{
	char sig[4];
	fw_cfg_get(FW_CFG_SIGNATURE, sig, sizeof(sig));
	return sig[0] == 'Q' && sig[1] == 'E' && sig[2] == 'M' && sig[3] == 'U';
}

unsigned cpu_count(void)
{
	u8 b[2];
	if (!fw_cfg_present())
		return 1;
	fw_cfg_get(FW_CFG_NB_CPUS, b, sizeof(b));
	unsigned n = b[0] | (unsigned)b[1] << 8;
	return n ? n : 1;
}
