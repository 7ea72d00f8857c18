# Disk images booted through BIOS firmware (included by guests/Makefile).
#
#   $(O)/bootsect.img         boot sector + 64 pattern sectors, read once
#   $(O)/bootsect-long.img    the same, read BOOTSECT_LONG_PASSES times (snapshot/migration tests)
#   $(O)/bootsect-nosig.img   the boot sector without its 0x55aa signature
#   $(O)/boot/loader.bin      a Multiboot v1 loader (boot sector + stage 2)
#   $(O)/disk/NAME.img        the loader with guest NAME.elf behind it
#
# Only gcc and binutils: 16-bit code is GNU as with .code16, the loader's
# 32-bit half is C built with -m32.

BOOT_O := $(O)/boot
BOOTSECT_LONG_PASSES ?= 100

BOOT_CFLAGS := -m32 -march=i386 -std=gnu11 -Os -Wall -Wextra -Werror \
	-ffreestanding -nostdlib -fno-pic -fno-pie -mgeneral-regs-only \
	-fno-stack-protector -fcf-protection=none -fno-asynchronous-unwind-tables \
	-fno-unwind-tables -fno-tree-loop-distribute-patterns -Iboot
BOOT_ASFLAGS := -m32 -Iboot -Wa,--noexecstack
BOOT_LDFLAGS := -m elf_i386 -nostdlib -static --build-id=none -z noexecstack \
	--no-warn-rwx-segments

BOOT_IMAGES := $(O)/bootsect.img $(O)/bootsect-long.img $(O)/bootsect-nosig.img \
	$(BOOT_O)/loader.bin $(GUESTS:%=$(O)/disk/%.img)

all: $(BOOT_IMAGES)

# bootsect IMAGE, CPP-DEFINES
define bootsect
	@mkdir -p $(BOOT_O)
	$(CC) $(BOOT_ASFLAGS) $(2) -c -o $(BOOT_O)/$(notdir $(1)).o boot/bootsect.S
	$(LD) $(BOOT_LDFLAGS) -Ttext=0x7c00 -e _start --oformat binary \
		-o $(1).tmp $(BOOT_O)/$(notdir $(1)).o
	truncate -s 1M $(1).tmp
	@mv $(1).tmp $(1)
endef

$(O)/bootsect.img: boot/bootsect.S boot/rmio.inc boot/boot.mk
	$(call bootsect,$@,)

$(O)/bootsect-long.img: boot/bootsect.S boot/rmio.inc boot/boot.mk
	$(call bootsect,$@,-DPASSES=$(BOOTSECT_LONG_PASSES))

$(O)/bootsect-nosig.img: boot/bootsect.S boot/rmio.inc boot/boot.mk
	$(call bootsect,$@,-DNO_SIGNATURE)

$(BOOT_O)/loader-s.o: boot/loader.S boot/loader.h boot/rmio.inc boot/boot.mk
	@mkdir -p $(@D)
	$(CC) $(BOOT_ASFLAGS) -c -o $@ $<

$(BOOT_O)/loader-c.o: boot/loader.c boot/loader.h boot/boot.mk
	@mkdir -p $(@D)
	$(CC) $(BOOT_CFLAGS) -c -o $@ $<

$(BOOT_O)/loader.bin: $(BOOT_O)/loader-s.o $(BOOT_O)/loader-c.o boot/loader.ld
	$(LD) $(BOOT_LDFLAGS) -T boot/loader.ld -o $(BOOT_O)/loader.elf \
		$(BOOT_O)/loader-s.o $(BOOT_O)/loader-c.o
	objcopy -O binary $(BOOT_O)/loader.elf $@

$(O)/disk/%.img: $(O)/%.elf $(BOOT_O)/loader.bin boot/mkdisk.sh
	@mkdir -p $(@D)
	strip -s -o $(BOOT_O)/$*.stripped $<
	sh boot/mkdisk.sh $(BOOT_O)/loader.bin $(BOOT_O)/$*.stripped $@

.PHONY: clean-boot
clean: clean-boot
clean-boot:
	rm -rf $(BOOT_IMAGES) $(BOOT_O) $(O)/disk
