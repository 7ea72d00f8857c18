/*
 * virtio-drivers-blk: a third-party virtio driver against the VMM's devices.
 * The `virtio-drivers` crate (rust/, built for x86_64-unknown-none and
 * linked in as a static library) does everything in ring 3: its PciRoot over
 * ECAM enumerates bus 0, its PCI transport and VirtIOBlk write a pattern
 * over `count=64` sectors at `start=0`, FLUSH, read back and compare, GET_ID
 * (compared with `serial=` when given); `ro=1` expects the write refused
 * with IOERR instead.  With a virtio-rng device its VirtIORng reads twice,
 * expecting data that is not constant and differs.  This file only finds
 * the ECAM base from the ACPI MCFG (or `ecam=`), places unassigned BARs with
 * `pci_assign=1` (no firmware), and calls the Rust entry at CPL 3.
 * Output lines start with "vd-blk: "; the crate's warnings with
 * "virtio-drivers: ".
 */
#include "kit.h"

/* rust/src/lib.rs: NULL on success, else a reason. */
const char *vd_blk_main(u64 ecam_base);

static u64 ring3(u64 arg)
{
	(void)arg;
	if (pci_init(PCI_MECH_ECAM) != PCI_MECH_ECAM)
		fail("no MCFG (nor ecam=): the virtio-drivers guest needs ECAM");
	u64 base = pci_ecam_base();
	printf("vd-blk: ECAM at 0x%lx\n", base);
	if (cmdline_uint("pci_assign", 0)) {	/* no firmware: the crate needs BARs placed */
		pci_scan();
		pci_assign_unassigned();
	}
	const char *reason = vd_blk_main(base);
	if (reason)
		fail("virtio-drivers-blk: %s", reason);
	return 0;
}

void guest_main(void)
{
	enter_ring3(ring3, 0);
	pass();
}
