# Scrapes /metrics every 100 ms on one keep-alive connection, as Prometheus does; on SIGTERM prints
# how many scrapes, their median time and the body size.
import http.client, signal, sys, time
host, port = sys.argv[1].split(":")
times, size = [], 0
def done(*_):
    times.sort()
    print("scrapes %d, median %.2f ms, max %.2f ms, %d bytes" % (len(times), 1e3 * times[len(times)//2], 1e3 * times[-1], size), file=sys.stderr)
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
c = http.client.HTTPConnection(host, int(port))
while True:
    t = time.perf_counter()
    c.request("GET", "/metrics"); body = c.getresponse().read()
    times.append(time.perf_counter() - t); size = len(body)
    time.sleep(max(0.0, 0.1 - (time.perf_counter() - t)))
