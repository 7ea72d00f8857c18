//! KVM's GSI routing table. The kernel keeps one table per VM and KVM_SET_GSI_ROUTING
//! replaces it whole, but two parts of the machine own routes in it: the interrupt
//! controllers (kernel mode: the PC wiring of the in-kernel PIC and IOAPIC pins; split mode:
//! the MSI each user-space IOAPIC pin sends) and the devices (one MSI route per irqfd, at
//! GSIs from `FIRST_MSI_GSI`). `GsiRoutes` holds both and builds their union, so writing one
//! part never drops the other.

use std::collections::BTreeMap;

use kvm_bindings::{
    kvm_irq_routing_entry, kvm_irq_routing_irqchip, kvm_irq_routing_msi, KvmIrqRouting,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP,
    KVM_IRQ_ROUTING_MSI, KVM_MAX_IRQ_ROUTES,
};

use crate::{HypervisorError, IrqChipPin, IrqRoute, MsiMessage, Result, FIRST_MSI_GSI};

/// Pins of KVM's in-kernel I/O APIC.
const KVM_IOAPIC_NUM_PINS: u32 = 24;

/// Both owners' routes, as last written to the kernel.
#[derive(Clone, Default)]
pub struct GsiRoutes {
    /// The interrupt controllers' routes, all at GSIs below `FIRST_MSI_GSI`.
    base: Vec<kvm_irq_routing_entry>,
    /// Device MSIs by GSI (at or above `FIRST_MSI_GSI`).
    devices: BTreeMap<u32, MsiMessage>,
}

fn msi_entry(gsi: u32, msi: &MsiMessage) -> kvm_irq_routing_entry {
    let mut entry = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_MSI,
        ..Default::default()
    };
    entry.u.msi = kvm_irq_routing_msi {
        address_lo: msi.address as u32,
        address_hi: (msi.address >> 32) as u32,
        data: msi.data,
        ..Default::default()
    };
    entry
}

fn irqchip_entry(gsi: u32, irqchip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut entry = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_IRQCHIP,
        ..Default::default()
    };
    entry.u.irqchip = kvm_irq_routing_irqchip { irqchip, pin };
    entry
}

impl GsiRoutes {
    /// Kernel irqchip mode: the lines of the in-kernel 8259 pair and I/O APIC, as the VMM
    /// wires them (KVM's default table, which sends GSI 0 to pin 0, is replaced).
    pub fn set_irqchip_routes(&mut self, routes: &[IrqRoute]) -> Result<()> {
        let mut entries = Vec::with_capacity(routes.len());
        for route in routes {
            let (chip, pin, pins) = match route.pin {
                IrqChipPin::PicMaster(pin) => (KVM_IRQCHIP_PIC_MASTER, pin, 8),
                IrqChipPin::PicSlave(pin) => (KVM_IRQCHIP_PIC_SLAVE, pin, 8),
                IrqChipPin::Ioapic(pin) => (KVM_IRQCHIP_IOAPIC, pin, KVM_IOAPIC_NUM_PINS),
            };
            if route.gsi >= FIRST_MSI_GSI || pin >= pins {
                return Err(HypervisorError::Invalid(format!(
                    "irqchip route {route:?}: the controllers own GSIs below {FIRST_MSI_GSI}, \
                     and this chip has {pins} inputs"
                )));
            }
            entries.push(irqchip_entry(route.gsi, chip, pin));
        }
        self.base = entries;
        Ok(())
    }

    /// Split irqchip mode: the MSI each user-space IOAPIC pin sends (GSI = pin).
    pub fn set_ioapic_msis(&mut self, routes: &[(u32, MsiMessage)]) -> Result<()> {
        if let Some((gsi, _)) = routes.iter().find(|(gsi, _)| *gsi >= FIRST_MSI_GSI) {
            return Err(HypervisorError::Invalid(format!(
                "IOAPIC route for GSI {gsi}: the interrupt controllers own GSIs below \
                 {FIRST_MSI_GSI}"
            )));
        }
        self.base = routes
            .iter()
            .map(|(gsi, msi)| msi_entry(*gsi, msi))
            .collect();
        Ok(())
    }

    /// Sets (or with `None` removes) the MSI of device GSI `gsi`.
    pub fn set_device_msi(&mut self, gsi: u32, msi: Option<MsiMessage>) -> Result<()> {
        let max = KVM_MAX_IRQ_ROUTES as u32;
        if !(FIRST_MSI_GSI..max).contains(&gsi) {
            return Err(HypervisorError::Invalid(format!(
                "device MSI route for GSI {gsi}: device GSIs are {FIRST_MSI_GSI} to {}",
                max - 1
            )));
        }
        match msi {
            Some(msi) => self.devices.insert(gsi, msi),
            None => self.devices.remove(&gsi),
        };
        Ok(())
    }

    /// The union of both parts, as KVM_SET_GSI_ROUTING takes it.
    pub fn table(&self) -> Result<KvmIrqRouting> {
        let device_entries = self.devices.iter().map(|(gsi, msi)| msi_entry(*gsi, msi));
        let entries: Vec<kvm_irq_routing_entry> =
            self.base.iter().copied().chain(device_entries).collect();
        KvmIrqRouting::from_entries(&entries).map_err(|_| {
            HypervisorError::Invalid(format!(
                "{} GSI routes (KVM takes at most {KVM_MAX_IRQ_ROUTES})",
                entries.len()
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (gsi, type, MSI data or irqchip pin) of every entry of the table.
    fn summary(routes: &GsiRoutes) -> Vec<(u32, u32, u32)> {
        let table = routes.table().unwrap();
        table
            .as_slice()
            .iter()
            .map(|e| {
                // SAFETY: the union member read is the one `type_` names.
                let detail = unsafe {
                    if e.type_ == KVM_IRQ_ROUTING_MSI {
                        e.u.msi.data
                    } else {
                        e.u.irqchip.pin
                    }
                };
                (e.gsi, e.type_, detail)
            })
            .collect()
    }

    #[test]
    fn irqchip_routes_become_irqchip_entries_and_bad_ones_are_refused() {
        let mut routes = GsiRoutes::default();
        let wiring = [
            IrqRoute {
                gsi: 0,
                pin: IrqChipPin::PicMaster(0),
            },
            IrqRoute {
                gsi: 0,
                pin: IrqChipPin::Ioapic(2),
            },
            IrqRoute {
                gsi: 9,
                pin: IrqChipPin::PicSlave(1),
            },
        ];
        routes.set_irqchip_routes(&wiring).unwrap();
        assert_eq!(
            summary(&routes),
            vec![
                (0, KVM_IRQ_ROUTING_IRQCHIP, 0),
                (0, KVM_IRQ_ROUTING_IRQCHIP, 2),
                (9, KVM_IRQ_ROUTING_IRQCHIP, 1)
            ]
        );
        for bad in [
            IrqRoute {
                gsi: 24,
                pin: IrqChipPin::Ioapic(1),
            },
            IrqRoute {
                gsi: 3,
                pin: IrqChipPin::PicMaster(8),
            },
            IrqRoute {
                gsi: 3,
                pin: IrqChipPin::Ioapic(24),
            },
        ] {
            assert!(routes.set_irqchip_routes(&[bad]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn device_routes_survive_a_new_ioapic_table_and_the_other_way_round() {
        let mut routes = GsiRoutes::default();
        routes
            .set_ioapic_msis(&[(4, MsiMessage::fixed(0, 0x34))])
            .unwrap();
        routes
            .set_device_msi(24, Some(MsiMessage::fixed(1, 0x50)))
            .unwrap();
        routes
            .set_ioapic_msis(&[(8, MsiMessage::fixed(0, 0x38))])
            .unwrap();
        assert_eq!(
            summary(&routes),
            vec![
                (8, KVM_IRQ_ROUTING_MSI, 0x38),
                (24, KVM_IRQ_ROUTING_MSI, 0x50)
            ]
        );
        routes
            .set_device_msi(30, Some(MsiMessage::fixed(0, 0x51)))
            .unwrap();
        routes.set_device_msi(24, None).unwrap();
        assert_eq!(
            summary(&routes),
            vec![
                (8, KVM_IRQ_ROUTING_MSI, 0x38),
                (30, KVM_IRQ_ROUTING_MSI, 0x51)
            ]
        );
    }

    #[test]
    fn each_owner_stays_in_its_gsi_range() {
        let mut routes = GsiRoutes::default();
        let msi = MsiMessage::fixed(0, 0x40);
        assert!(routes.set_device_msi(23, Some(msi)).is_err());
        assert!(routes.set_device_msi(4096, Some(msi)).is_err());
        assert!(routes.set_device_msi(4095, Some(msi)).is_ok());
        let err = routes.set_ioapic_msis(&[(24, msi)]).unwrap_err();
        assert!(err.to_string().contains("GSI 24"), "{err}");
    }
}
