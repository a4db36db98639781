//! The handle pool: device memory created and exported ahead of demand, so that a grant costs an
//! fd passed over a socket, not a create and an export on the grant's path (the export is the
//! driver's expensive call: docs/design.md, "What the hardware costs").
//!
//! Fresh handles are memory no tenant has seen. A handle a tenant gives back is kept only for
//! that same tenant's next grant of its size (`recycle`), or released; never handed to another
//! tenant, so a tenant that kept an import of it reaches nothing of the next owner's. Pooled memory
//! is the daemon's; it is given up whenever a grant needs the room.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vram_core::Bytes;
use vram_device::{Device, DeviceError, Handle};
use vram_proto::PoolTakes;

use crate::config::PoolConfig;

/// A handle with the fd it was exported as.
pub struct Ready {
    pub handle: Handle,
    pub fd: OwnedFd,
}

struct SizeState {
    ready: Vec<Ready>,
    /// How many handles of this size to keep ready: doubles on a miss, halves for each
    /// [`Pool::idle`] that passes without a take; handles ready beyond it are released.
    target: usize,
    last_demand: Instant,
}

/// The `tenant` for [`Pool::take`] that no recycled handle belongs to: fresh memory only.
pub const FRESH_ONLY: u64 = u64::MAX;

/// Handles one tenant may leave for its own next grants.
const RECYCLE_PER_TENANT: usize = 8;

struct PoolState {
    /// Handles given back, by the tenant (id) they may go back to.
    recycled: HashMap<u64, Vec<Ready>>,
    sizes: HashMap<Bytes, SizeState>,
    pooled: Bytes,
    /// Room the pool may fill: the broker's free memory, updated by the daemon.
    room: Bytes,
    /// The refill thread waits for work: only then does it need waking (a wake-up per grant would
    /// cost the grant's round trip a context switch on a small machine).
    sleeping: bool,
    takes: PoolTakes,
}

pub struct Pool {
    device: Arc<dyn Device>,
    config: PoolConfig,
    /// How long a size goes without a take before its target halves.
    idle: Duration,
    state: Mutex<PoolState>,
    wake: Condvar,
    stop: AtomicBool,
}

/// A size idle this long has its target halved (so 1 GiB of 64 MiB handles that nobody asks for
/// again goes back within a minute).
const IDLE_DECAY: Duration = Duration::from_secs(10);

impl Pool {
    pub fn new(device: Arc<dyn Device>, config: PoolConfig) -> Arc<Pool> {
        Self::with_idle(device, config, IDLE_DECAY)
    }

    /// A pool whose sizes' targets halve after `idle` without a take.
    fn with_idle(device: Arc<dyn Device>, config: PoolConfig, idle: Duration) -> Arc<Pool> {
        let now = Instant::now();
        let sizes = config
            .sizes
            .iter()
            .map(|s| {
                let state = SizeState {
                    ready: Vec::new(),
                    target: config.initial,
                    last_demand: now,
                };
                (*s, state)
            })
            .collect();
        Arc::new(Pool {
            device,
            config,
            idle,
            state: Mutex::new(PoolState {
                sizes,
                pooled: Bytes::ZERO,
                room: Bytes::ZERO,
                recycled: HashMap::new(),
                sleeping: false,
                takes: PoolTakes::default(),
            }),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        })
    }

    /// Starts the background thread that keeps the pool filled. One thread: more refill threads
    /// compete with the tenants' own imports and maps on the driver and slow them, and making a
    /// request's missing handles side by side does not make its grant faster (docs/benchmarks.md,
    /// "The daemon's pool: settings compared").
    pub fn start(self: &Arc<Self>) -> std::thread::JoinHandle<()> {
        let pool = self.clone();
        std::thread::Builder::new()
            .name("vramd-pool".into())
            .spawn(move || pool.refill_loop())
            .expect("spawn pool thread")
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.wake.notify_all();
    }

    /// How grants found their handle since start.
    pub fn takes(&self) -> PoolTakes {
        self.lock().takes
    }

    /// Memory held ready.
    pub fn pooled(&self) -> Bytes {
        self.lock().pooled
    }

    /// Tells the pool how much it may hold without standing in a grant's way.
    pub fn set_room(&self, room: Bytes) {
        let mut s = self.lock();
        let wake = room > s.room && s.sleeping;
        s.room = room;
        drop(s);
        if wake {
            self.wake.notify_all();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ready handle of `size` for `tenant`: one it gave back itself, else a fresh pooled one,
    /// else a new one made now. On the device running out, pooled memory is given up and the
    /// create tried once more.
    pub fn take(&self, tenant: u64, size: Bytes) -> Result<Ready, DeviceError> {
        let mut one = self.take_many(tenant, &[size])?;
        Ok(one.pop().expect("one size asked, one handle"))
    }

    /// Ready handles of `sizes`, in order, as [`Pool::take`] finds each; the ones the pool does
    /// not have are made now, one after another (see [`Pool::start`]). All of them, or the
    /// first error.
    pub fn take_many(&self, tenant: u64, sizes: &[Bytes]) -> Result<Vec<Ready>, DeviceError> {
        let found: Vec<Option<Ready>> = sizes
            .iter()
            .map(|&size| self.take_ready(tenant, size))
            .collect();
        if found.iter().any(Option::is_none) {
            self.wake.notify_all();
        }
        // On an error, what was found and made is dropped: released, never handed out.
        found
            .into_iter()
            .zip(sizes)
            .map(|(r, &size)| r.map_or_else(|| self.make_now(size), Ok))
            .collect()
    }

    /// A handle of `size` that is ready now (recycled for `tenant`, or pooled), counting the take;
    /// on a miss, the pool keeps more of that size ready from then on.
    fn take_ready(&self, tenant: u64, size: Bytes) -> Option<Ready> {
        if let Some(r) = self.take_recycled(tenant, size) {
            return Some(r);
        }
        let mut s = self.lock();
        let entry = s.sizes.entry(size).or_insert_with(|| SizeState {
            ready: Vec::new(),
            target: 0,
            last_demand: Instant::now(),
        });
        entry.last_demand = Instant::now();
        if let Some(r) = entry.ready.pop() {
            // Refill in batches: wake the refill thread once half the target is gone.
            let low = entry.ready.len() <= entry.target / 2;
            s.pooled -= size;
            s.takes.hits += 1;
            let wake = low && s.sleeping;
            drop(s);
            if wake {
                self.wake.notify_all();
            }
            return Some(r);
        }
        // A miss: keep more of this size ready from now on.
        let max_count = (self.config.max.get() / size.get().max(1)) as usize;
        entry.target = (entry.target * 2).clamp(1, max_count.max(1));
        s.takes.misses += 1;
        None
    }

    /// A handle made now for a grant. The device may be full of pooled memory, or of a handle a
    /// refill thread is making right now (not evictable until it lands): give way, and give the
    /// refill a moment.
    fn make_now(&self, size: Bytes) -> Result<Ready, DeviceError> {
        let mut attempt = 0;
        loop {
            match self.make(size) {
                Err(DeviceError::OutOfMemory { .. }) if attempt < 20 => {
                    attempt += 1;
                    if !self.evict(size) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                other => return other,
            }
        }
    }

    /// New memory, exported. It reads as zeros: memfds by construction; on CUDA the driver zeroes
    /// what `cuMemCreate` returns, even memory another process just released
    /// (`freshness_experiment` in vram-device's GPU tests checks it, and every tenant test checks
    /// its grants arrive zeroed). The daemon has no CUDA context to scrub with, by design
    /// (docs/design.md, "What the hardware costs").
    fn make(&self, size: Bytes) -> Result<Ready, DeviceError> {
        let handle = self.device.create(size)?;
        let fd = self.device.export(&handle)?;
        Ok(Ready { handle, fd })
    }

    /// Keeps a handle `tenant` gave back, for that tenant's next grant of the same size: it saves
    /// a create and an export, and hands the tenant nothing it has not seen. Another tenant never
    /// gets it. Returns the handle if there is no room to keep it.
    /// `room` is what the pool may hold once the caller's books are updated (they are updated
    /// after this call, so that no grant counts on memory that is not back yet).
    pub fn recycle(&self, tenant: u64, ready: Ready, room: Bytes) -> Option<Ready> {
        let size = ready.handle.size();
        let mut s = self.lock();
        let room = s.room.max(room).min(self.config.max);
        let bin = s.recycled.entry(tenant).or_default();
        if bin.len() >= RECYCLE_PER_TENANT || s.pooled + size > room {
            return Some(ready);
        }
        s.recycled.entry(tenant).or_default().push(ready);
        s.pooled += size;
        None
    }

    /// Takes out what `tenant` left to recycle (it is gone), for the caller to drop: the caller
    /// may hold its own lock, and releasing memory is a driver call.
    #[must_use = "the handles are released when dropped"]
    pub fn forget(&self, tenant: u64) -> Vec<Ready> {
        let mut s = self.lock();
        let bin = s.recycled.remove(&tenant).unwrap_or_default();
        s.pooled -= bin.iter().map(|r| r.handle.size()).sum();
        bin
    }

    fn take_recycled(&self, tenant: u64, size: Bytes) -> Option<Ready> {
        let mut s = self.lock();
        let bin = s.recycled.get_mut(&tenant)?;
        let i = bin.iter().position(|r| r.handle.size() == size)?;
        let r = bin.swap_remove(i);
        s.pooled -= size;
        s.takes.recycled += 1;
        Some(r)
    }

    /// Gives up pooled handles until the pool holds at most `room` (the memory it stood in was
    /// taken by someone vramd does not serve).
    pub fn shrink_to(&self, room: Bytes) {
        let over = self.pooled().saturating_sub(room);
        if over > Bytes::ZERO {
            self.evict(over);
        }
    }

    /// Releases pooled handles until `need` could be created; whether anything was released.
    fn evict(&self, need: Bytes) -> bool {
        let mut freed = Bytes::ZERO;
        let mut victims = Vec::new();
        {
            let mut s = self.lock();
            let state = &mut *s;
            let bins = state.sizes.values_mut().map(|st| &mut st.ready);
            for bin in bins.chain(state.recycled.values_mut()) {
                while freed < need {
                    let Some(r) = bin.pop() else { break };
                    freed += r.handle.size();
                    victims.push(r);
                }
            }
            s.pooled -= freed;
        }
        let any = !victims.is_empty();
        drop(victims);
        any
    }

    /// Gives up everything pooled (shutdown, or an operator's request).
    pub fn drain(&self) {
        let victims: Vec<Ready> = {
            let mut s = self.lock();
            s.pooled = Bytes::ZERO;
            let mut all: Vec<Ready> = s.recycled.drain().flat_map(|(_, bin)| bin).collect();
            all.extend(s.sizes.values_mut().flat_map(|st| st.ready.drain(..)));
            all
        };
        drop(victims);
    }

    /// Halves the target of each size that went [`Pool::idle`] without a take, and takes out the
    /// handles ready beyond their size's target, for the caller to release outside the lock:
    /// memory made ahead for a demand that stopped goes back to the device. A size no one asks
    /// for any more, and not configured, is forgotten (tenants choose sizes: kept, their entries
    /// would only grow).
    fn release_idle(&self) -> Vec<Ready> {
        let mut s = self.lock();
        let now = Instant::now();
        let mut idle = Vec::new();
        for st in s.sizes.values_mut() {
            if now.duration_since(st.last_demand) > self.idle && st.target > 0 {
                st.target /= 2;
                st.last_demand = now;
            }
            if st.ready.len() > st.target {
                idle.extend(st.ready.drain(st.target..));
            }
        }
        let configured = &self.config.sizes;
        s.sizes
            .retain(|size, st| st.target > 0 || !st.ready.is_empty() || configured.contains(size));
        s.pooled -= idle.iter().map(|r| r.handle.size()).sum();
        idle
    }

    fn refill_loop(&self) {
        while !self.stop.load(Ordering::Acquire) {
            let idle = self.release_idle();
            drop(idle);
            let want = {
                let mut s = self.lock();
                let room = s.room.min(self.config.max);
                let pooled = s.pooled;
                let want = s
                    .sizes
                    .iter()
                    .filter(|(size, st)| st.ready.len() < st.target && pooled + **size <= room)
                    .map(|(size, _)| *size)
                    .min();
                if want.is_none() {
                    s.sleeping = true;
                    let mut s = self
                        .wake
                        .wait_timeout(s, Duration::from_secs(1))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    s.sleeping = false;
                    continue;
                }
                want
            };
            let Some(size) = want else { continue };
            let made = self.make(size);
            let mut s = self.lock();
            match made {
                Ok(r) => {
                    // Its size is still known: sizes are forgotten only by `release_idle`, on
                    // this thread. (Were it not, the handle would be dropped, not counted.)
                    if let Some(st) = s.sizes.get_mut(&size) {
                        st.ready.push(r);
                        s.pooled += size;
                    }
                }
                Err(e) => {
                    tracing::debug!(%size, "pool refill stopped: {e}");
                    s.sleeping = true;
                    let mut s = self
                        .wake
                        .wait_timeout(s, Duration::from_millis(200))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    s.sleeping = false;
                }
            }
        }
        self.drain();
    }
}

#[cfg(test)]
mod tests {
    use vram_device::HostDevice;

    use super::*;

    fn pool(capacity: Bytes) -> (Arc<dyn Device>, Arc<Pool>) {
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new(capacity, Bytes::mib(2)).unwrap());
        let cfg = PoolConfig {
            max: Bytes::mib(16),
            sizes: vec![Bytes::mib(2)],
            initial: 2,
        };
        (dev.clone(), Pool::new(dev, cfg))
    }

    #[test]
    fn fills_ahead_within_its_room_and_gives_way() {
        let (dev, pool) = pool(Bytes::mib(8));
        pool.set_room(Bytes::mib(8));
        let t = pool.start();
        let deadline = Instant::now() + Duration::from_secs(5);
        while pool.pooled() < Bytes::mib(4) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(pool.pooled(), Bytes::mib(4));
        // A take is served from the pool.
        let a = pool.take(1, Bytes::mib(2)).unwrap();
        // A size the pool never held, larger than what is free: pooled memory gives way.
        pool.set_room(Bytes::ZERO);
        let b = pool.take(1, Bytes::mib(6)).unwrap();
        assert_eq!(dev.used(), Bytes::mib(8));
        let takes = pool.takes();
        assert_eq!((takes.hits, takes.recycled, takes.misses), (1, 0, 1));
        // Given back, `a` is kept for its tenant's next grant of its size.
        assert!(pool.recycle(1, a, Bytes::mib(2)).is_none());
        let a = pool.take(1, Bytes::mib(2)).unwrap();
        assert_eq!(pool.takes().recycled, 1);
        drop((a, b));
        pool.stop();
        t.join().unwrap();
        assert_eq!(dev.used(), Bytes::ZERO);
    }

    #[test]
    fn memory_made_for_a_demand_that_stopped_goes_back() {
        let dev: Arc<dyn Device> =
            Arc::new(HostDevice::new(Bytes::mib(64), Bytes::mib(2)).unwrap());
        let cfg = PoolConfig {
            max: Bytes::mib(32),
            sizes: vec![],
            initial: 0,
        };
        let pool = Pool::with_idle(dev.clone(), cfg, Duration::from_millis(100));
        pool.set_room(Bytes::mib(64));
        let t = pool.start();
        let wait_for = |what: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !what() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            what()
        };
        // Takes of a size the pool never held miss: it makes that size ready ahead.
        let taken: Vec<Ready> = (0..3)
            .map(|_| pool.take(1, Bytes::mib(4)).unwrap())
            .collect();
        assert!(pool.takes().misses >= 1);
        assert!(
            wait_for(&|| pool.pooled() >= Bytes::mib(4)),
            "{}",
            pool.pooled()
        );
        // Nobody asks again: the target halves each idle period and what is ready beyond it goes
        // back to the device, while the tenant keeps what it took. (The pool's count drops
        // before the memory is released, outside its lock: wait for both.)
        assert!(
            wait_for(&|| pool.pooled() == Bytes::ZERO && dev.used() == Bytes::mib(12)),
            "pooled {}, device {}",
            pool.pooled(),
            dev.used()
        );
        // Its target down to nothing, the size is forgotten.
        assert!(wait_for(&|| pool.lock().sizes.is_empty()));
        drop(taken);
        pool.stop();
        t.join().unwrap();
        assert_eq!(dev.used(), Bytes::ZERO);
    }

    #[test]
    fn take_many_makes_what_it_lacks_and_leaks_nothing_when_one_cannot_be_made() {
        let (dev, pool) = pool(Bytes::mib(16));
        // Not started: nothing pooled, so every size is a miss, made at once.
        let sizes = [Bytes::mib(2), Bytes::mib(4), Bytes::mib(6)];
        let got = pool.take_many(1, &sizes).unwrap();
        let made: Vec<Bytes> = got.iter().map(|r| r.handle.size()).collect();
        assert_eq!(made, sizes);
        assert_eq!(pool.takes().misses, 3);
        assert_eq!(dev.used(), Bytes::mib(12));
        // 12 MiB used of 16: a request for 2 + 4 MiB cannot all be made; none of it is kept.
        let Err(err) = pool.take_many(1, &[Bytes::mib(2), Bytes::mib(4)]) else {
            panic!("made more than the device holds");
        };
        assert!(matches!(err, DeviceError::OutOfMemory { .. }), "{err}");
        assert_eq!(dev.used(), Bytes::mib(12));
        drop(got);
        assert_eq!(dev.used(), Bytes::ZERO);
    }
}
