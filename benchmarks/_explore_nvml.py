"""Scratch: explore NVML behaviour on a real GPU (deleted before hand-off)."""
import threading, time, json, math
import pynvml as N
import torch

N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
out = {}
def t(fn, *a, n=30):
    try:
        fn(*a)
    except N.NVMLError as e:
        return f"ERR {e.value} {e}"
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*a)
    return round((time.perf_counter() - t0) / n * 1e6, 1)
def fv(ids):
    return [(x.fieldId, x.nvmlReturn, x.valueType, x.timestamp, x.value.ullVal, x.value.dVal, x.value.uiVal) for x in N.nvmlDeviceGetFieldValues(h, ids)]
out["fields_static"] = fv([83, 185, 186, 191, 197, 198])
out["cost_us"] = {str(ids): t(N.nvmlDeviceGetFieldValues, h, ids) for ids in ([83], [197, 198], [83, 197, 198], [186], [83, 186, 197, 198], [191])}
out["cost_us"]["energy_fn"] = t(N.nvmlDeviceGetTotalEnergyConsumption, h)
ids = [2, 3, 5, 10, 20, 21]
s1, s2 = N.nvmlGpmSampleAlloc(), N.nvmlGpmSampleAlloc()
def gpm(dt):
    N.nvmlGpmSampleGet(h, s1); time.sleep(dt); N.nvmlGpmSampleGet(h, s2)
    m = N.c_nvmlGpmMetricsGet_t(); m.version = N.NVML_GPM_METRICS_GET_VERSION; m.numMetrics = len(ids)
    m.sample1 = s1; m.sample2 = s2
    for i, mid in enumerate(ids): m.metrics[i].metricId = mid
    N.nvmlGpmMetricsGet(m)
    return [(m.metrics[i].nvmlReturn, round(m.metrics[i].value, 3)) for i in range(len(ids))]
out["gpm_idle"] = [gpm(0.1) for _ in range(3)] + [gpm(0.01) for _ in range(3)]
stop = False
def load():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); hb = torch.randn(256 * 2**20 // 4).pin_memory()
    while not stop:
        for _ in range(20): a @ a
        hb.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
th = threading.Thread(target=load); th.start(); time.sleep(1.0)
ser = []
for i in range(40):
    ser.append([time.time(), N.nvmlDeviceGetTotalEnergyConsumption(h), N.nvmlDeviceGetPowerUsage(h)] + fv([83, 186, 185]))
    time.sleep(0.025)
out["energy_series"] = ser
res = {}
for dt in [0.03, 0.05, 0.07, 0.08, 0.09, 0.095]:
    r = [gpm(dt) for _ in range(10)]
    res[str(dt)] = [sum(1 for x in r if all(v == 0 or math.isnan(v) for _, v in x[:4])), r[:4]]
out["gpm_load"] = res
stop = True; th.join()
print(json.dumps(out, indent=None, default=str))
