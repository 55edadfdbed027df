"""Worker extension used by the RL-control tests (imported by name in the engine process)."""


class MemoryProbe:
    def fill_kv_cache(self) -> int:
        """Touch every page of the KV cache, so resident memory shows its full size."""
        cache = self.model_runner.kv_cache
        cache.zero_()
        return cache.numel() * cache.element_size()

    def weight_bytes(self) -> int:
        """This rank's weights (0 while dropped by a level-2 sleep)."""
        if self.model is None:
            return 0
        return sum(v.numel() * v.element_size() for _, v in self.model.hf_views())

    def pid(self) -> int:
        import os

        return os.getpid()

    def rss_bytes(self) -> int:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) * 1024

    def cuda_bytes(self) -> dict:
        """Device memory as torch's allocator and as the driver see it: `used` on the whole card,
        `process` this process's own (NVML; None where it cannot tell), which other processes on
        the card do not move."""
        import os

        import torch

        free, total = torch.cuda.mem_get_info()
        process = None
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            process = next((p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                            if p.pid == os.getpid()), None)
        except Exception:  # no NVML (nvidia-ml-py) here, or no per-process accounting
            pass
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "used": total - free, "process": process}

    def packed_by_the_update(self) -> list[str]:
        """The tensors the last update staged straight into their linears' panels (their plain
        weights not unpacked yet: read nothing in between)."""
        behind = self.model._behind
        layout = self._buffers._layout or ()
        return sorted(e["name"] for st in layout if st.linear is not None and id(st.linear) in behind
                      for e in st.entries)
