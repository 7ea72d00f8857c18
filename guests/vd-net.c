/*
 * virtio-drivers-net: the `virtio-drivers` crate's VirtIONetRaw (rust/src/net.rs,
 * linked in from the same static library as virtio-drivers-blk) against the
 * VMM's virtio-net device, in ring 3: its PciRoot over ECAM finds the device,
 * its PCI transport starts it, then ARP for the peer 10.0.2.2 and `rounds=10`
 * UDP echoes on port 7777, each checked.  This file finds the ECAM base
 * (ACPI MCFG or `ecam=`), places unassigned BARs with `pci_assign=1`,
 * measures the TSC at CPL 0 and calls the Rust entry at CPL 3.
 */
#include "kit.h"

/* rust/src/lib.rs: NULL on success, else a reason. */
const char *vd_net_main(u64 ecam_base);

static u64 ring3(u64 arg)
{
	(void)arg;
	if (pci_init(PCI_MECH_ECAM) != PCI_MECH_ECAM)
		fail("no MCFG (nor ecam=): the virtio-drivers guest needs ECAM");
	u64 base = pci_ecam_base();
	printf("vd-net: ECAM at 0x%lx\n", base);
	if (cmdline_uint("pci_assign", 0)) {	/* no firmware: the crate needs BARs placed */
		pci_scan();
		pci_assign_unassigned();
	}
	const char *reason = vd_net_main(base);
	if (reason)
		fail("virtio-drivers-net: %s", reason);
	return 0;
}

void guest_main(void)
{
	tsc_hz();
	enter_ring3(ring3, 0);
	pass();
}
