//! The device manager: builds the machine's devices in phases (interrupt controllers on the
//! buses, timers, console, the PC's legacy devices, PCI bus 0 and its functions), each
//! registering into the buses and the lifecycle list, and hands the rest of the machine
//! what reaches them: the vCPUs the buses, the timer thread its devices, the API the
//! keyboard and the console, snapshots and migration the lifecycle list.

use std::sync::{Arc, Mutex};

use devices::acpi_pm::AcpiPm;
use devices::bus::{Bus, BusError, IoDispatcher};
use devices::debug_exit::DebugExit;
use devices::exit::ExitRequest;
use devices::fw_cfg::FwCfg;
use devices::i8042::I8042;
use devices::irqchip::{IrqChip, IrqPin};
use devices::pit::Pit;
use devices::rtc::Rtc;
use hypervisor::{Capabilities, Vm};
use pci::{HostBridge, PciBus, PciLayout, Window};

use crate::config::{IrqChipKind, VmConfig};
use crate::error::{Error, Result};
use crate::firmware;
use crate::irqchip::MachineIrqChip;
use crate::memory::GuestMemory;
use crate::platform::{add_virtio_devices, PciHandles, PlatformDevices, VirtioContext};
use crate::power::PowerControl;
use crate::state::{DeviceList, SharedDevice};
use crate::timers::{PitTimer, TimedDevice, TimerDevices, TimerWake};

/// The ACPI SCI line, as the FADT and MADT advertise it.
const ACPI_SCI_IRQ: u32 = 9;
/// The CMOS RTC's periodic/alarm/update interrupt.
const RTC_IRQ: u32 = 8;

/// What the device phases need from the machine built before them.
pub struct DeviceContext<'a> {
    pub config: &'a VmConfig,
    pub vm: &'a Arc<dyn Vm>,
    pub caps: &'a Capabilities,
    pub irqchip: &'a Arc<dyn MachineIrqChip>,
    pub memory: &'a Arc<GuestMemory>,
    pub exit: &'a Arc<ExitRequest>,
    pub power: &'a Arc<PowerControl>,
    /// The firmware ROM's memory (firmware machines).
    pub firmware: Option<&'a firmware::FirmwareMemory>,
}

/// The devices of a built machine, as the rest of it reaches them.
pub struct MachineDevices {
    /// What the vCPUs dispatch port I/O and MMIO exits to.
    pub pio: Arc<IoDispatcher>,
    pub mmio: Arc<IoDispatcher>,
    /// Every device in restore order, for snapshots, migration and reset.
    pub list: DeviceList,
    /// What the timer thread drives.
    pub timers: TimerDevices,
    /// COM1's output queue, drained at exit.
    pub serial_output: Option<Arc<devices::output::OutputQueue>>,
    /// The console's device (COM1 or hvc0) and its input, started when the machine runs.
    pub serial_input: Option<ConsoleInput>,
    /// The i8042, whose keyboard the API presses Ctrl+Alt+Del on.
    pub keyboard: Option<Arc<Mutex<I8042>>>,
}

/// Devices registered so far; see the module documentation.
pub struct DeviceManager<'a> {
    ctx: &'a DeviceContext<'a>,
    irqchip: Arc<dyn IrqChip>,
    pio: Bus,
    mmio: Bus,
    timer_wake: Arc<TimerWake>,
    /// The PIT and the RTC where the VMM models them, in restore order.
    timer_list: Vec<SharedDevice>,
    /// The same, as the timer thread serves them.
    timed: Vec<Arc<dyn TimedDevice>>,
    /// Power management's wake alarm.
    rtc: Option<Arc<Mutex<Rtc>>>,
    /// Serial, i8042, fw_cfg, ACPI PM and the firmware machine's extras, in restore order.
    pc: Vec<SharedDevice>,
    fw_cfg: Option<Arc<Mutex<FwCfg>>>,
    keyboard: Option<Arc<Mutex<I8042>>>,
    serial_output: Option<Arc<devices::output::OutputQueue>>,
    serial_input: Option<ConsoleInput>,
    /// hvc0 (`--console virtio`), until it goes on the PCI bus.
    virtio_console: Option<virtio::console::Console>,
    /// (PCI address, device id) of the listed devices: the ids states before format 4
    /// saved them under.
    former_ids: Vec<(String, String)>,
}

/// The device console input feeds, and where that input comes from.
pub type ConsoleInput = (
    Box<dyn crate::console::InputTarget>,
    crate::console::SerialInput,
);

fn bus_error(e: BusError) -> Error {
    Error::Devices(e.to_string())
}

impl<'a> DeviceManager<'a> {
    /// Builds every device of the machine `ctx` describes, phase by phase.
    pub fn build(ctx: &'a DeviceContext<'a>) -> Result<MachineDevices> {
        let mut manager = DeviceManager::new(ctx)?;
        manager.add_timers()?;
        manager.add_console()?;
        manager.add_pc_devices()?;
        let pci = build_pci(
            ctx.config.memory,
            ctx.config.firmware.is_some(),
            &manager.irqchip,
            &mut manager.pio,
            &mut manager.mmio,
        )?;
        let functions = manager.add_pci_functions(&pci)?;
        manager.finish(pci, functions)
    }

    /// The interrupt controllers' registers go on the buses first.
    fn new(ctx: &'a DeviceContext<'a>) -> Result<Self> {
        let (mut pio, mut mmio) = (Bus::new(), Bus::new());
        ctx.irqchip.register(&mut pio, &mut mmio)?;
        Ok(DeviceManager {
            ctx,
            irqchip: ctx.irqchip.clone() as Arc<dyn IrqChip>,
            pio,
            mmio,
            timer_wake: Arc::new(TimerWake::default()),
            timer_list: Vec::new(),
            timed: Vec::new(),
            rtc: None,
            pc: Vec::new(),
            fw_cfg: None,
            keyboard: None,
            serial_output: None,
            serial_input: None,
            former_ids: Vec::new(),
            virtio_console: None,
        })
    }

    fn irq_pin(&self, gsi: u32) -> IrqPin {
        IrqPin::new(self.irqchip.clone(), gsi)
    }

    /// The PIT where the VMM models it (split mode) and the RTC where the kernel does not
    /// (bhyve owns ports 0x70-0x71: a model here would never be reached).
    fn add_timers(&mut self) -> Result<()> {
        if self.ctx.irqchip.kind() == IrqChipKind::Split {
            let mut pit = Pit::new();
            pit.set_waker(self.timer_wake.clone());
            let pit = pit.register(&mut self.pio).map_err(bus_error)?;
            self.timer_list.push(pit.clone());
            let irqchip = self.irqchip.clone();
            self.timed.push(Arc::new(PitTimer { pit, irqchip }));
        }
        if !self.ctx.caps.rtc_in_kernel {
            let mut rtc = Rtc::new(self.irq_pin(RTC_IRQ));
            rtc.set_waker(self.timer_wake.clone());
            let (below_4g, above_4g) = ram_below_and_above_4g(self.ctx.config.memory);
            rtc.set_memory_sizes(below_4g, above_4g);
            let rtc = rtc.register(&mut self.pio).map_err(bus_error)?;
            self.timer_list.push(rtc.clone());
            self.timed.push(rtc.clone());
            self.rtc = Some(rtc);
        }
        Ok(())
    }

    /// COM1, its output queue, hvc0 if asked for, and which of them takes the input.
    fn add_console(&mut self) -> Result<()> {
        let config = self.ctx.config;
        let irq = Arc::new(self.irq_pin(devices::serial::COM1_IRQ));
        let com1 = crate::console::build_com1(&config.serial, irq, &mut self.pio)?;
        self.pc.push(com1.device.clone());
        self.serial_output = com1.output;
        let mut target: Box<dyn crate::console::InputTarget> = Box::new(com1.device);
        let virtio_console = config
            .devices
            .any(|d| matches!(d, crate::config::DeviceConfig::Console(_)));
        if virtio_console {
            let hvc = crate::console::build_virtio_console(&config.serial, com1.input.as_ref())?;
            if let Some(port) = hvc.input_port() {
                target = Box::new(port);
            }
            self.virtio_console = Some(hvc);
        }
        self.serial_input = com1.input.map(|input| (target, input));
        Ok(())
    }

    /// Debug-exit, the i8042, fw_cfg and ACPI PM (wired to power management), and a
    /// firmware machine's port 0x92 and debug console.
    fn add_pc_devices(&mut self) -> Result<()> {
        let (config, exit) = (self.ctx.config, self.ctx.exit);
        DebugExit::new(exit.clone())
            .register(&mut self.pio)
            .map_err(bus_error)?;
        let i8042 = I8042::new(exit.clone())
            .with_keyboard_irq(self.irq_pin(devices::i8042::KEYBOARD_IRQ))
            .register(&mut self.pio)
            .map_err(bus_error)?;
        let mut fw_cfg = FwCfg::new(config.cpus as u16, config.memory);
        fw_cfg
            .add_file("etc/ferrovm/cmdline", config.cmdline.as_bytes().to_vec())
            .map_err(|e| Error::Devices(e.to_string()))?;
        let fw_cfg = fw_cfg.register(&mut self.pio).map_err(bus_error)?;
        let acpi_pm = AcpiPm::new(exit.clone())
            .with_sci(Arc::new(self.irq_pin(ACPI_SCI_IRQ)))
            .with_sleep_control(self.ctx.power.clone())
            .register(&mut self.pio)
            .map_err(bus_error)?;
        self.ctx.power.attach(acpi_pm.clone(), self.rtc.clone());
        self.pc
            .extend([i8042.clone() as SharedDevice, fw_cfg.clone(), acpi_pm]);
        if config.firmware.is_some() {
            let extras = firmware::add_legacy_devices(&mut self.pio, exit).map_err(bus_error)?;
            self.pc.extend(extras);
        }
        self.keyboard = Some(i8042);
        self.fw_cfg = Some(fw_cfg);
        Ok(())
    }

    /// The functions on bus 0 beside the host bridge: the PIIX functions of a firmware
    /// machine, then the virtio devices; firmware learns where they are through fw_cfg.
    /// The PIIX reset control register (0xcf9) ends the VM as a reset.
    fn add_pci_functions(&mut self, pci: &PciHandles) -> Result<Vec<SharedDevice>> {
        let ctx = self.ctx;
        let exit = ctx.exit.clone();
        pci.bus.set_reset_handler(Arc::new(move || {
            exit.request(devices::exit::ExitReason::Reset);
        }));
        let mut functions = match ctx.firmware {
            Some(_) => firmware::add_piix(pci)?,
            None => Vec::new(),
        };
        let virtio = add_virtio_devices(
            ctx.config,
            &VirtioContext {
                vm: ctx.vm,
                irqchip: ctx.irqchip,
                caps: ctx.caps,
                memory: ctx.memory,
                pci,
            },
            self.virtio_console.take(),
        )?;
        if let (Some(fw), Some(fw_cfg)) = (ctx.firmware, &self.fw_cfg) {
            let machine = firmware::MachineParts {
                pci,
                fw_cfg,
                virtio: &virtio,
                kernel_pm_timer: ctx.caps.pm_timer_port,
            };
            firmware::attach(fw, ctx.config, &machine)?;
        }
        for placed in virtio {
            let address = format!("pci-00:{:02x}.0", placed.slot);
            self.former_ids.push((address, placed.id));
            functions.push(placed.function);
        }
        Ok(functions)
    }

    /// The lifecycle list in restore order (see [`PlatformDevices::into_list`]), the buses
    /// made immutable, and the handles the rest of the machine keeps.
    fn finish(self, pci: PciHandles, functions: Vec<SharedDevice>) -> Result<MachineDevices> {
        let mut legacy = self.pc;
        legacy.extend(self.timer_list);
        let platform = PlatformDevices {
            legacy,
            pci,
            irqchip: Some(self.ctx.irqchip.clone()),
        };
        let timers = TimerDevices {
            devices: self.timed,
            wake: self.timer_wake,
            gate: Arc::default(),
        };
        let mut list = platform.into_list(functions)?;
        for (former, id) in self.former_ids {
            list.add_former_id(former, id);
        }
        Ok(MachineDevices {
            pio: Arc::new(IoDispatcher::new("pio", Arc::new(self.pio))),
            mmio: Arc::new(IoDispatcher::new("mmio", Arc::new(self.mmio))),
            list,
            timers,
            serial_output: self.serial_output,
            serial_input: self.serial_input,
            keyboard: self.keyboard,
        })
    }
}

/// Guest RAM below the 32-bit MMIO hole and above 4 GiB, as firmware reports it.
pub fn ram_below_and_above_4g(memory: u64) -> (u64, u64) {
    let below_4g = memory.min(boot::layout::MMIO_HOLE_START);
    (below_4g, memory - below_4g)
}

/// The PCI platform of every machine: bus 0 with the host bridge in slot 0, configuration
/// mechanism #1 and the I/O BAR window on `pio`, ECAM and the memory BAR windows on `mmio`,
/// in the windows `boot::layout` fixes (and the firmware tables describe), INTx lines on
/// `irqchip`. Functions are added with `PciBus::add_device` through the returned handle
/// before the vCPUs start; `PciBus::intx_line` gives a function its INTx line.
fn build_pci(
    memory: u64,
    firmware: bool,
    irqchip: &Arc<dyn IrqChip>,
    pio: &mut Bus,
    mmio: &mut Bus,
) -> Result<PciHandles> {
    use boot::layout::{
        pci_mmio64_start, PCI_ECAM_SIZE, PCI_ECAM_START, PCI_IO_SIZE, PCI_IO_START,
        PCI_MMIO32_SIZE, PCI_MMIO32_START, PCI_MMIO64_SIZE,
    };
    let pci_err = |e: pci::PciError| Error::Devices(e.to_string());
    let layout = PciLayout {
        ecam: Window::new(PCI_ECAM_START, PCI_ECAM_SIZE),
        // BIOS firmware places BARs itself, anywhere in the hole below the IOAPIC (SeaBIOS:
        // downwards from there); the bus decodes all of it, ECAM excepted.
        mmio32: if firmware {
            Window::new(
                PCI_MMIO32_START,
                boot::layout::IOAPIC_START - PCI_MMIO32_START,
            )
        } else {
            Window::new(PCI_MMIO32_START, PCI_MMIO32_SIZE)
        },
        mmio64: Window::new(pci_mmio64_start(memory), PCI_MMIO64_SIZE),
        io: Window::new(PCI_IO_START, PCI_IO_SIZE),
    };
    let bus = Arc::new(PciBus::new(layout, irqchip.clone()).map_err(pci_err)?);
    let host_bridge = Arc::new(Mutex::new(HostBridge::new()));
    bus.add_device_at(0, host_bridge.clone()).map_err(pci_err)?;
    bus.register(pio, mmio)
        .map_err(|e| Error::Devices(format!("PCI: {e}")))?;
    Ok(PciHandles { bus, host_bridge })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_read(pio: &Bus, reg: u32) -> u32 {
        assert!(pio.write(0xcf8, &(0x8000_0000 | reg).to_le_bytes()));
        let mut data = [0u8; 4];
        assert!(pio.read(0xcfc, &mut data));
        u32::from_le_bytes(data)
    }

    /// What the guest changed on the PCI platform comes back through the machine state.
    #[test]
    fn pci_platform_round_trips_through_the_machine_state() {
        let (mut pio, mut mmio) = (Bus::new(), Bus::new());
        let irqchip: Arc<dyn IrqChip> = Arc::new(devices::serial::NoIrq);
        let source = build_pci(256 << 20, false, &irqchip, &mut pio, &mut mmio).unwrap();
        assert_eq!(config_read(&pio, 0), 0x1237_8086);
        // PAM1 and the interrupt line through ECAM, the command register through CF8.
        assert!(mmio.write(0xe000_005a, &[0x33]));
        assert!(mmio.write(0xe000_003c, &[0x0b]));
        assert!(pio.write(0xcf8, &0x8000_0004u32.to_le_bytes()));
        assert!(pio.write(0xcfc, &[0x02, 0x04]));
        let saved = as_list(&source).save().unwrap();
        let json = serde_json::to_vec(&saved).unwrap();

        let (mut pio, mut mmio) = (Bus::new(), Bus::new());
        let target = build_pci(256 << 20, false, &irqchip, &mut pio, &mut mmio).unwrap();
        as_list(&target)
            .restore(&serde_json::from_slice(&json).unwrap())
            .unwrap();
        assert_eq!(config_read(&pio, 0x58) >> 16 & 0xff, 0x33, "PAM1");
        assert_eq!(config_read(&pio, 4) & 0xffff, 0x0402, "command");
        assert_eq!(lock_host_bridge(&target).pam()[1], 0x33);
        assert_eq!(config_read(&pio, 0x3c) & 0xff, 0x0b, "interrupt line");
    }

    /// The manager registers every device of a split-irqchip machine (rng on PCI) in the
    /// lifecycle order snapshots and migration rely on, and hands the timer thread both
    /// timers it models.
    #[test]
    fn devices_register_in_restore_order() {
        use crate::config::{SerialOutput, StartFrom};
        let mut config = VmConfig::new(StartFrom::Kernel("k".into()));
        config.irqchip = IrqChipKind::Split;
        config.serial = SerialOutput::None;
        let rng = crate::config::DeviceConfig::Rng(Default::default());
        config.devices.add(None, rng).unwrap();
        let vm: Arc<dyn Vm> = Arc::new(crate::irqchip::FakeVm::default());
        let caps = Capabilities {
            irqchip_split: true,
            ..Default::default()
        };
        let irqchip = crate::irqchip::create(&vm, config.irqchip, &caps).unwrap();
        let memory = Arc::new(crate::memory::create_guest_memory(16 << 20, false).unwrap());
        let exit = Arc::new(ExitRequest::new().unwrap());
        let power = Arc::new(PowerControl::new(1, false, memory.clone()));
        let ctx = DeviceContext {
            config: &config,
            vm: &vm,
            caps: &caps,
            irqchip: &irqchip,
            memory: &memory,
            exit: &exit,
            power: &power,
            firmware: None,
        };
        let devices = DeviceManager::build(&ctx).unwrap();
        let ids: Vec<&str> = devices.list.ids().collect();
        let expected = [
            "serial",
            "i8042",
            "fw_cfg",
            "acpi_pm",
            "pit",
            "rtc",
            "pci-00:00.0",
            "rng0",
            "pci-bus",
            "irqchip",
        ];
        assert_eq!(ids, expected);
        assert_eq!(devices.timers.devices.len(), 2, "PIT and RTC");
        assert!(devices.keyboard.is_some());
        // COM1's scratch register answers on the immutable PIO bus.
        assert!(devices.pio.write(0x3ff, &[0x5a]));
        let mut scratch = [0u8];
        assert!(devices.pio.read(0x3ff, &mut scratch));
        assert_eq!(scratch, [0x5a]);
    }

    /// A machine's lifecycle list holding only the PCI platform.
    fn as_list(pci: &PciHandles) -> crate::state::DeviceList {
        PlatformDevices {
            legacy: Vec::new(),
            pci: pci.clone(),
            irqchip: None,
        }
        .into_list(Vec::new())
        .unwrap()
    }

    fn lock_host_bridge(pci: &PciHandles) -> std::sync::MutexGuard<'_, HostBridge> {
        pci.host_bridge.lock().unwrap()
    }
}
