/*
 * virtio-drivers-vsock: the `virtio-drivers` crate's socket driver
 * (VirtIOSocket under its VsockConnectionManager, PCI transport; rust/src/
 * vsock.rs) against the VMM's virtio-vsock, in ring 3: an echo through a
 * host port, then an echo of a host client's stream into a listening port.
 * This file finds the ECAM base (ACPI MCFG) and calls the Rust entry.
 * Output lines start with "vd-vsock: ".
 */
#include "kit.h"

/* rust/src/vsock.rs: NULL on success, else a reason. */
const char *vd_vsock_main(u64 ecam_base);

static u64 ring3(u64 arg)
{
	(void)arg;
	if (pci_init(PCI_MECH_ECAM) != PCI_MECH_ECAM)
		fail("no MCFG (nor ecam=): the virtio-drivers guest needs ECAM");
	const char *reason = vd_vsock_main(pci_ecam_base());
	if (reason)
		fail("virtio-drivers-vsock: %s", reason);
	return 0;
}

void guest_main(void)
{
	enter_ring3(ring3, 0);
	pass();
}
