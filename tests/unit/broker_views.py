"""What the broker is shown of a device and of a kernel (parking.broker's DeviceView, KernelView), built as the broker's
tests need them: one device key each, a kernel's label from its id."""

from gpu_quota_ext.parking.broker import DeviceView, KernelView


def device_view(used, total: int, key=0) -> DeviceView:
    return DeviceView(key=key, name=f"GPU {key}", total=total, used=used)


def kernel_view(kernel_id: str, state: str, used: int, cap: int, idle_for, parkable: bool = True, key=0) -> KernelView:
    return KernelView(
        kernel_id=kernel_id,
        state=state,
        used={key: used} if used else {},
        caps={key: cap},
        idle_for=idle_for,
        parkable=parkable,
        label=f"kernel {kernel_id}",
    )
