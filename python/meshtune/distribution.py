"""keras.distribution for meshtune: a DeviceMesh over the job's processes (`mpirun -np N python3
script.py`; one process is a mesh of one), a LayoutMap of regex rules, ModelParallel /
DataParallel, and the global distribution that `GemmaCausalLM.from_preset` loads under.

The devices are the processes of the job, one device each: `list_devices()` names them "gpu:0" …
"gpu:N-1" in rank order where this process has a usable NVIDIA GPU (as JAX lists its GPUs first;
each process computes on the GPU of its local rank), else "cpu:0" … "cpu:N-1" (each computes on
its CPU cores). A model loaded under a distribution computes on its mesh's kind of device.
"""
from meshtune import _checks
from meshtune._engine import engine

_current = None


def list_devices(device_type=None):
    kind = None if device_type is None else str(device_type).lower()
    if kind not in (None, "cpu", "gpu", "cuda", "tpu"):
        raise ValueError(f"list_devices: unknown device_type {device_type!r} (cpu, gpu or tpu)")
    if kind == "tpu":
        return []
    has_gpu = kind != "cpu" and engine.gpu_count() > 0
    if kind in ("gpu", "cuda") and not has_gpu:
        return []
    return [f"{'gpu' if has_gpu else 'cpu'}:{i}" for i in range(engine.world_size())]


def _backend():
    """The engine's backend for models loaded now: the global distribution's kind of device, else
    the default kind (a GPU when this process has one, as JAX's default)."""
    devices = _current.device_mesh.devices if _current is not None else list_devices()
    return "cuda" if devices and str(devices[0]).startswith("gpu") else "cpu"


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """The job is started by mpirun, which already connects the processes: this checks what is
    given against it."""
    if num_processes is not None and _checks.integer("num_processes", num_processes, 1) != engine.world_size():
        raise ValueError(f"initialize: num_processes={num_processes}, but this job has {engine.world_size()} "
                         "processes (start it with mpirun -np N)")
    if process_id is not None and _checks.integer("process_id", process_id, 0) != engine.world_rank():
        raise ValueError(f"initialize: process_id={process_id}, but this process is rank {engine.world_rank()}")


class DeviceMesh:
    def __init__(self, shape, axis_names, devices=None):
        if isinstance(shape, (int,)) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)):
            raise TypeError(f"DeviceMesh: shape must be a tuple of integers, got {type(shape).__name__}")
        self.shape = tuple(_checks.integer("DeviceMesh shape", s, 1, 1 << 20) for s in shape)
        if isinstance(axis_names, str):
            axis_names = [axis_names]
        self.axis_names = _checks.strings("DeviceMesh axis_names", axis_names)
        if len(self.axis_names) != len(self.shape):
            raise ValueError(f"DeviceMesh: {len(self.shape)} dimensions {self.shape} but {len(self.axis_names)} "
                             f"axis names {self.axis_names}")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"DeviceMesh: axis names must differ, got {self.axis_names}")
        size = 1
        for s in self.shape:
            size *= s
        if devices is None:
            devices = list_devices()
        devices = list(devices)
        if len(devices) != size:
            raise ValueError(f"DeviceMesh: shape {self.shape} needs {size} devices, got {len(devices)} "
                             f"(the devices are this job's processes: start it with mpirun -np {size})")
        self.devices = devices

    def __repr__(self):
        return f"<DeviceMesh shape={self.shape}, axis_names={self.axis_names}>"


class TensorLayout:
    def __init__(self, axes, device_mesh=None):
        self.axes = _axes("TensorLayout axes", axes)
        self.device_mesh = device_mesh


def _axes(what, value):
    if isinstance(value, TensorLayout):
        return value.axes
    if isinstance(value, str) or value is None:
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{what} must be a tuple of mesh axis names or None, got {type(value).__name__}")
    for a in value:
        if a is not None and not isinstance(a, str):
            raise TypeError(f"{what} must hold mesh axis names or None, got {type(a).__name__}")
    return tuple(value)


class LayoutMap:
    """Regex rules from variable paths to per-dimension mesh axes: layout_map[regex] = (None, "model")."""

    def __init__(self, device_mesh):
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"LayoutMap: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
        self.device_mesh = device_mesh
        self._rules = {}

    def __setitem__(self, key, layout):
        _checks.string("LayoutMap key", key)
        if key in self._rules:
            raise ValueError(f"LayoutMap: key {key!r} already has a layout")
        self._rules[key] = _axes(f"LayoutMap[{key!r}]", layout)

    def __getitem__(self, key):
        import re
        if key in self._rules:
            return self._rules[key]
        matches = [k for k in self._rules if re.search(k, key)]
        if len(matches) > 1:
            raise ValueError(f"LayoutMap: path {key!r} matches more than one key: {matches}")
        return self._rules[matches[0]] if matches else None

    def __delitem__(self, key):
        del self._rules[key]

    def __len__(self):
        return len(self._rules)

    def __iter__(self):
        return iter(self._rules)

    def items(self):
        return self._rules.items()


class Distribution:
    def __init__(self, device_mesh, batch_dim_name):
        self.device_mesh = device_mesh
        self.batch_dim_name = batch_dim_name

    def _options(self):
        raise NotImplementedError


class ModelParallel(Distribution):
    """ModelParallel(device_mesh, layout_map, batch_dim_name="batch") as the tutorial writes it, or
    ModelParallel(layout_map=…, batch_dim_name=…) as current Keras does (the mesh is the map's)."""

    def __init__(self, device_mesh=None, layout_map=None, batch_dim_name=None, auto_shard_dataset=None, **kwargs):
        _checks.not_implemented("ModelParallel", auto_shard_dataset=auto_shard_dataset)
        for name in kwargs:
            raise TypeError(f"ModelParallel: unexpected argument {name}=")
        if isinstance(device_mesh, LayoutMap) and layout_map is None:
            device_mesh, layout_map = None, device_mesh
        if not isinstance(layout_map, LayoutMap):
            raise TypeError(f"ModelParallel: layout_map must be a LayoutMap, got {type(layout_map).__name__}")
        if device_mesh is None:
            device_mesh = layout_map.device_mesh
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"ModelParallel: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
        if batch_dim_name is None:
            batch_dim_name = device_mesh.axis_names[0]
        _checks.string("batch_dim_name", batch_dim_name)
        if batch_dim_name not in device_mesh.axis_names:
            raise ValueError(f"ModelParallel: batch_dim_name {batch_dim_name!r} is not an axis of the mesh "
                             f"{device_mesh.axis_names}")
        super().__init__(device_mesh, batch_dim_name)
        self._layout_map = layout_map

    def _options(self):
        return {"mesh_shape": list(self.device_mesh.shape), "axis_names": list(self.device_mesh.axis_names),
                "rules": [(k, list(v)) for k, v in self._layout_map.items()], "batch_axis": self.batch_dim_name}


class DataParallel(Distribution):
    def __init__(self, device_mesh=None, devices=None, auto_shard_dataset=None):
        _checks.not_implemented("DataParallel", auto_shard_dataset=auto_shard_dataset)
        if device_mesh is None:
            devices = list_devices() if devices is None else list(devices)
            device_mesh = DeviceMesh((len(devices),), ["batch"], devices)
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"DataParallel: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
        super().__init__(device_mesh, device_mesh.axis_names[0])

    def _options(self):
        return {"mesh_shape": list(self.device_mesh.shape), "axis_names": list(self.device_mesh.axis_names),
                "batch_axis": self.batch_dim_name}


def set_distribution(value):
    global _current
    if value is not None and not isinstance(value, Distribution):
        raise TypeError(f"set_distribution: expected a ModelParallel or DataParallel, got {type(value).__name__}")
    _current = value


def distribution():
    return _current
