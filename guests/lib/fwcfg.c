/* QEMU-compatible fw_cfg over I/O ports 0x510 (selector) / 0x511 (data). */
#include "kit.h"

void fw_cfg_select(u16 key)
{
	outw(FW_CFG_PORT_SEL, key);
}

void fw_cfg_read(void *buf, size_t len)
{
	u8 *p = buf;
	while (len--)
		*p++ = inb(FW_CFG_PORT_DATA);
}

bool fw_cfg_present(void)
{
	char sig[4];
	fw_cfg_select(FW_CFG_SIGNATURE);
	fw_cfg_read(sig, sizeof(sig));
	return sig[0] == 'Q' && sig[1] == 'E' && sig[2] == 'M' && sig[3] == 'U';
}

unsigned cpu_count(void)
{
	u8 b[2];
	if (!fw_cfg_present())
		return 1;
	fw_cfg_select(FW_CFG_NB_CPUS);
	fw_cfg_read(b, sizeof(b));
	unsigned n = b[0] | (unsigned)b[1] << 8;
	return n ? n : 1;
}
