//! One connection: who the peer is, what it asks, and cleaning up after it whatever way it ends.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::histogram::Histogram;
use vram_core::broker::{Tenant, TenantId, TenantRequest};
use vram_core::Bytes;
use vram_proto::{
    ErrorCode, ErrorReply, Hello, ProtoError, Reply, Request, Role, SharedRequest, Welcome,
};

use super::exit::Ended;
use super::peer::Peer;
use super::slot::ReclaimSender;
use super::Daemon;
use crate::logging::{Clipped, Every};
use crate::metrics::TenantLabels;

/// The most bytes of a peer's text (its client name, a refusal quoting its request) a log line
/// shows.
const SHOWN: usize = 256;

/// A registered tenant on this connection.
struct Registered {
    slot: usize,
    id: TenantId,
    name: String,
    /// Its grant latency series, when metrics are served.
    grant_seconds: Option<(TenantLabels, Histogram)>,
    /// Whether the driver's figures were read since it registered (see `first_driver_check`).
    driver_checked: bool,
    /// Its process's start time, to tell it from a later process with its pid.
    start_time: Option<u64>,
    /// What it held when it said `Bye`: it is finishing, not crashing.
    bye: Option<vram_proto::Budget>,
    /// A process that joined a tenant `vramd run` registered: when it ends, its memory goes back
    /// and the tenant stays, registered by `vramd run`'s connection.
    member: bool,
}

struct Session {
    daemon: Arc<Daemon>,
    conn_id: u64,
    peer: Arc<Peer>,
    pid: u32,
    uid: u32,
    tenant: Option<Registered>,
    /// Refusals and malformed requests, logged at most once per `LOG_EVERY`.
    warnings: Every,
    /// What the peer reports (how its program ended, reclaims answered): a peer that repeats
    /// them is logged at most once per `LOG_EVERY` too.
    reports: Every,
    /// A reconnecting tenant's account sent ahead of its `Hello` (`ResumeMore`), for the
    /// `Hello`'s `resume`.
    resume_more: Vec<(vram_proto::GrantId, Bytes)>,
    /// A `Hello` came (whatever its role): `ResumeMore` no longer may.
    hello_seen: bool,
}

/// Serves connection `conn_id` (admitted by the accept loop) until it ends, then cleans up.
pub fn run(daemon: Arc<Daemon>, conn_id: u64, peer: Arc<Peer>) {
    let mut session = Session {
        daemon,
        conn_id,
        pid: peer.pid,
        uid: peer.uid,
        peer,
        tenant: None,
        warnings: Every::default(),
        reports: Every::default(),
        resume_more: Vec::new(),
        hello_seen: false,
    };
    // A request whose handling panicked (a defect: no input is meant to) ends the connection as
    // a crash would, its tenant's memory reclaimed, rather than leave the tenant booked with no
    // one serving it.
    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| session.serve()));
    if served.is_err() {
        tracing::error!(
            conn = conn_id,
            "serving the connection panicked: it is closed and its tenant's memory reclaimed"
        );
    }
    let peer = session.peer.clone();
    session.finish();
    // The peer hears the end only now, with what the connection held released: a client that
    // closes waits for this, so that what it held is back when its close returns.
    let _ = peer.conn.stream().shutdown(std::net::Shutdown::Both);
}

impl Session {
    fn serve(&mut self) {
        // Until its first request a connection is on a clock: a silent peer does not keep a
        // connection (and a thread) for ever.
        let mut idle = Some(self.daemon.settings().connections.hello_timeout());
        loop {
            let received = match self.peer.conn.recv_within::<Request>(idle) {
                Ok(r) => r,
                Err(ProtoError::Closed) => return,
                Err(ProtoError::Idle(waited)) => {
                    let message = format!(
                        "no request within {} s of connecting ([connections] hello_timeout_ms); \
                         closing the connection",
                        waited.as_secs_f64()
                    );
                    tracing::info!(pid = self.pid, uid = self.uid, "{message}");
                    self.send_error(0, ErrorCode::Protocol, message);
                    return;
                }
                Err(ProtoError::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                    ) =>
                {
                    return
                }
                Err(e) => {
                    self.daemon.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    if let Some(more) = self.warnings.due() {
                        tracing::warn!(pid = self.pid, more, "protocol error: {e}");
                    }
                    if e.is_recoverable() {
                        self.send_error(0, ErrorCode::Malformed, format!("malformed request: {e}"));
                        continue;
                    }
                    self.send_error(
                        0,
                        ErrorCode::Protocol,
                        format!("{e}; closing the connection"),
                    );
                    return;
                }
            };
            idle = None;
            // A client sends no descriptors; any it did are closed here.
            drop(received.fds);
            if !self.handle(received.id, received.msg) {
                return;
            }
        }
    }

    /// Answers one request; `false` ends the session.
    fn handle(&mut self, id: u64, request: Request) -> bool {
        let reply = match request {
            Request::Hello(hello) => self.hello(hello),
            Request::Status => Ok(Reply::Status(Box::new(self.daemon.status_reply(id)))),
            Request::Ping => Ok(Reply::Pong),
            Request::Grant { bytes } => return self.grant(id, bytes),
            Request::GrantMany { sizes } => return self.grant_many(id, sizes, true),
            Request::Shared(r) => {
                // Buffers, versions, pins and leases are memory the tenant holds: while a program
                // is joined they are the program's, and go back when it ends.
                let who = self.registered().and_then(|(slot, t)| {
                    if !matches!(r, SharedRequest::List { .. } | SharedRequest::Open { .. }) {
                        self.daemon.slots[slot].memory_side(t, self.conn_id)?;
                    }
                    Ok((slot, t))
                });
                return super::shared::serve(&self.daemon, &self.peer, who, id, r);
            }
            Request::Return { grants } => self.registered().and_then(|(slot, t)| {
                let (bytes, held) = self.daemon.slots[slot].give_back(t, &grants)?;
                Ok(Reply::Returned { bytes, held })
            }),
            Request::Usage { in_use, cached } => self.registered().map(|(slot, t)| {
                self.daemon.slots[slot].report_usage(t, in_use, cached);
                Reply::Ack
            }),
            Request::Charge { bytes } => self.charge(bytes),
            Request::Uncharge { bytes } => self.registered().map(|(slot, t)| {
                self.daemon.slots[slot].uncharge(t, bytes);
                Reply::Ack
            }),
            Request::Refused {
                bytes,
                reason,
                message,
            } => self.registered().map(|(slot, t)| {
                let reason = refusal_reason(&reason);
                self.daemon.slots[slot].count_refusal(t, reason);
                let message: String = message.chars().take(512).collect();
                self.log_refusal(
                    "refused in the tenant's library",
                    slot,
                    bytes,
                    None,
                    reason,
                    &message,
                );
                Reply::Ack
            }),
            Request::Budget => self.registered().and_then(|(slot, t)| {
                self.daemon.slots[slot]
                    .budget(t)
                    .map(Reply::Budget)
                    .ok_or_else(|| ErrorReply {
                        code: ErrorCode::NotRegistered,
                        reason: None,
                        message: "this tenant is no longer known".into(),
                    })
            }),
            Request::Bye => self.registered().map(|(slot, t)| {
                if let Some(r) = self.tenant.as_mut() {
                    r.bye = self.daemon.slots[slot].budget(t);
                }
                Reply::Ack
            }),
            Request::Invite => self.registered().and_then(|(slot, t)| {
                let token = self.daemon.slots[slot].invite(t, self.uid)?;
                Ok(Reply::Invitation { token })
            }),
            Request::Exited(status) => self.registered().map(|(slot, _)| {
                if let Some(more) = self.reports.due() {
                    let name = self.tenant.as_ref().map_or("", |t| t.name.as_str());
                    log_exit(name, slot, status, more);
                }
                Reply::Ack
            }),
            Request::Declare(d) => super::admin::declare(&self.daemon, self.uid, d),
            Request::Withdraw { name } => super::admin::withdraw(&self.daemon, self.uid, &name),
            Request::Declarations => super::admin::list(&self.daemon, self.uid),
            Request::ResumeMore { grants } => self.resume_more(grants),
            Request::ReclaimDone { ask, returned } => self.registered().map(|(slot, _)| {
                // The tenant's word: counted once per ask it was sent, and at most the device.
                if !self.peer.answers(ask) {
                    return Reply::Ack;
                }
                let returned = returned.min(self.daemon.slots[slot].capacity());
                if let Some(more) = self.reports.due() {
                    let name = self.tenant.as_ref().map_or("", |t| t.name.as_str());
                    tracing::info!(tenant = name, ask, %returned, more, "reclaim answered");
                }
                if let Some(m) = self.daemon.metrics() {
                    m.reclaim_answered(returned.get());
                }
                Reply::Ack
            }),
        };
        let reply = reply.unwrap_or_else(Reply::Error);
        self.send(id, &reply, &[])
    }

    /// Sends a reply, waiting at most `[connections] send_timeout_ms` for the peer to take it;
    /// `false`: the connection is over (gone, or a peer that does not read, now disconnected).
    fn send(&self, id: u64, reply: &Reply, fds: &[std::os::fd::BorrowedFd<'_>]) -> bool {
        match self.peer.reply(id, reply, fds) {
            Ok(()) => {
                self.peer.written();
                true
            }
            Err(ProtoError::SendTimeout(limit)) => {
                let tenant = self.tenant.as_ref().map_or("", |t| t.name.as_str());
                tracing::warn!(
                    tenant, pid = self.pid, limit_ms = limit.as_millis() as u64,
                    "tenant does not read its socket: a reply was not taken in time; disconnected, \
                     its memory is reclaimed as on a crash"
                );
                self.peer.disconnect();
                false
            }
            Err(_) => false,
        }
    }

    fn registered(&self) -> Result<(usize, TenantId), ErrorReply> {
        self.tenant
            .as_ref()
            .map(|t| (t.slot, t.id))
            .ok_or_else(|| ErrorReply {
                code: ErrorCode::NotRegistered,
                reason: None,
                message: "this request needs a Hello as a tenant first".into(),
            })
    }

    /// Keeps part of a reconnecting tenant's account for its `Hello`: at most as many grants as
    /// the largest device here could have granted.
    fn resume_more(
        &mut self,
        grants: Vec<(vram_proto::GrantId, Bytes)>,
    ) -> Result<Reply, ErrorReply> {
        let malformed = |message: String| ErrorReply {
            code: ErrorCode::Malformed,
            reason: None,
            message,
        };
        if self.hello_seen {
            return Err(malformed(
                "ResumeMore comes before the Hello it belongs to".into(),
            ));
        }
        let most = self
            .daemon
            .slots
            .iter()
            .map(|s| {
                let d = s.desc();
                d.capacity.get() / d.granularity.get().max(1)
            })
            .max()
            .unwrap_or(0);
        let total = (self.resume_more.len() + grants.len()) as u64;
        if total > most {
            self.resume_more = Vec::new();
            return Err(malformed(format!(
                "an account of {total} grants or more: more than any device here could have \
                 granted ({most})"
            )));
        }
        self.resume_more.extend(grants);
        Ok(Reply::Ack)
    }

    fn hello(&mut self, mut hello: Hello) -> Result<Reply, ErrorReply> {
        self.hello_seen = true;
        let ahead = std::mem::take(&mut self.resume_more);
        if let Some(r) = hello.resume.as_mut() {
            r.grants.extend(ahead);
        }
        if let Some(t) = &self.tenant {
            return Err(ErrorReply {
                code: ErrorCode::NotRegistered,
                reason: None,
                message: format!("this connection is already tenant `{}`", t.name),
            });
        }
        let (name, class, guarantee, limit) = match hello.role {
            Role::Tenant {
                name,
                class,
                guarantee,
                limit,
            } => (name, class, guarantee, limit),
            Role::Join { token } => return self.join(&token, &hello.client),
            Role::Observer => return Ok(Reply::Ack),
        };
        // A reconnecting tenant names the device by the number the daemon before gave it; the
        // device it was adopted on (found by UUID) is the one, though the numbering changed.
        let awaited = hello.resume.as_ref().and_then(|_| {
            let slots = &self.daemon.slots;
            slots
                .iter()
                .position(|s| s.awaits(&name, self.pid, self.uid))
        });
        let slot = awaited.unwrap_or(hello.gpu.unwrap_or(0) as usize);
        let Some(s) = self.daemon.slots.get(slot) else {
            return Err(ErrorReply {
                code: ErrorCode::Admission,
                reason: None,
                message: format!(
                    "gpu {slot} does not exist; this daemon serves {} device(s), 0 to {}",
                    self.daemon.slots.len(),
                    self.daemon.slots.len() - 1
                ),
            });
        };
        let request = TenantRequest {
            name,
            class,
            guarantee,
            limit,
            pid: self.pid,
            uid: self.uid,
            gids: self.peer.gids.clone(),
        };
        let connected = s.connect(request, self.conn_id, hello.resume.as_ref());
        let (id, t) = connected.inspect_err(|e| {
            if let Some(more) = self.warnings.due() {
                tracing::warn!(
                    pid = self.pid,
                    more,
                    "tenant refused at connect: {}",
                    Clipped(&e.message, SHOWN)
                );
            }
        })?;
        tracing::info!(
            tenant = t.name, class = t.class, guarantee = %t.guarantee, limit = %t.limit,
            pid = self.pid, gpu = slot, client = %Clipped(&hello.client, SHOWN), "tenant connected"
        );
        Ok(self.registered_as(slot, id, t, false))
    }

    /// Takes over the memory side of a tenant `vramd run` registered for this process.
    fn join(&mut self, token: &str, client: &str) -> Result<Reply, ErrorReply> {
        let slot = self
            .daemon
            .slots
            .iter()
            .position(|s| s.has_invitation(token))
            .ok_or_else(|| ErrorReply {
                code: ErrorCode::Admission,
                reason: None,
                message: "no such invitation (already taken by another process, or its tenant \
                          is gone): a second process of a `vramd run` program is a tenant of its \
                          own, named by VRAMD_TENANT"
                    .into(),
            })?;
        let s = &self.daemon.slots[slot];
        let joined = s.join(token, self.pid, self.uid, self.conn_id);
        let (id, t) = joined.inspect_err(|e| {
            if let Some(more) = self.warnings.due() {
                tracing::warn!(
                    pid = self.pid,
                    more,
                    "join refused: {}",
                    Clipped(&e.message, SHOWN)
                );
            }
        })?;
        tracing::info!(
            tenant = t.name,
            pid = self.pid,
            gpu = slot,
            client = %Clipped(client, SHOWN),
            "tenant's program joined"
        );
        Ok(self.registered_as(slot, id, t, true))
    }

    /// This connection is tenant `id` from now on (`member`: a process that joined it); the
    /// tenant's welcome.
    fn registered_as(&mut self, slot: usize, id: TenantId, t: Tenant, member: bool) -> Reply {
        let grant_seconds = self.daemon.metrics().map(|m| {
            let labels = m.labels(&t.name, &t.class, slot as u32);
            (labels.clone(), m.grant_histogram(&labels))
        });
        self.tenant = Some(Registered {
            slot,
            id,
            name: t.name.clone(),
            grant_seconds,
            driver_checked: false,
            start_time: super::state::process_start_time(self.pid),
            bye: None,
            member,
        });
        Reply::Welcome(Welcome {
            tenant: id.0,
            name: t.name,
            class: t.class,
            priority: t.priority,
            guarantee: t.guarantee,
            limit: t.limit,
            device: self.daemon.slots[slot].desc(),
        })
    }

    fn grant(&mut self, id: u64, bytes: Bytes) -> bool {
        self.grant_many(id, vec![bytes], false)
    }

    /// Grants handles of `sizes`, all or none, and sends them in one reply: `Granted` for a
    /// single `Grant`, else `GrantedMany`.
    fn grant_many(&mut self, id: u64, sizes: Vec<Bytes>, many: bool) -> bool {
        let (slot, tenant) = match self.registered() {
            Ok(r) => r,
            Err(e) => return self.send(id, &Reply::Error(e), &[]),
        };
        if let Err(e) = self.daemon.slots[slot].memory_side(tenant, self.conn_id) {
            return self.send(id, &Reply::Error(e), &[]);
        }
        if sizes.is_empty() || sizes.len() > vram_proto::MAX_FDS {
            let e = ErrorReply {
                code: ErrorCode::Refused,
                reason: Some("bad_size".into()),
                message: format!(
                    "one GrantMany asks for 1 to {} handles; this one asked for {}",
                    vram_proto::MAX_FDS,
                    sizes.len()
                ),
            };
            return self.send(id, &Reply::Error(e), &[]);
        }
        self.first_driver_check();
        let timeout = self.daemon.settings().reclaim_timeout;
        let started = Instant::now();
        let asker = Asker(&self.daemon, &self.peer);
        let granted =
            match self.daemon.slots[slot].grant_many(tenant, self.conn_id, &sizes, timeout, &asker)
            {
                Ok(g) => g,
                Err(e) => {
                    let asked = sizes.iter().fold(Bytes::ZERO, |a, b| a.saturating_add(*b));
                    let reason = e.reason.as_deref().unwrap_or("");
                    self.log_refusal(
                        "refused",
                        slot,
                        asked,
                        Some(sizes.len()),
                        reason,
                        &e.message,
                    );
                    return self.send(id, &Reply::Error(e), &[]);
                }
            };
        if let Some((_, h)) = self.tenant.as_ref().and_then(|t| t.grant_seconds.as_ref()) {
            h.observe(started.elapsed().as_secs_f64());
        }
        use std::os::fd::AsFd;
        let fds: Vec<_> = granted.iter().map(|g| g.2.as_fd()).collect();
        let reply = match (many, granted.as_slice()) {
            (false, [(grant, size, _)]) => Reply::Granted {
                grant: *grant,
                size: *size,
            },
            _ => Reply::GrantedMany {
                grants: granted.iter().map(|g| (g.0, g.1)).collect(),
            },
        };
        // If the tenant is gone by now, the grants are taken back with everything else.
        self.send(id, &reply, &fds)
    }

    /// Logs a refusal on this connection (`what: message`, with the tenant, device, bytes asked,
    /// handles when a grant's, and reason), at most once per `LOG_EVERY` with the count held back.
    fn log_refusal(
        &mut self,
        what: &str,
        slot: usize,
        asked: Bytes,
        handles: Option<usize>,
        reason: &str,
        message: &str,
    ) {
        let Some(more) = self.warnings.due() else {
            return;
        };
        let tenant = self.tenant.as_ref().map_or("", |t| t.name.as_str());
        tracing::warn!(
            tenant,
            gpu = slot,
            asked = asked.get(),
            handles,
            reason,
            more,
            "{what}: {message}"
        );
    }

    /// Books memory the tenant made itself; refusals are logged as a grant's are.
    fn charge(&mut self, bytes: Bytes) -> Result<Reply, ErrorReply> {
        let (slot, tenant) = self.registered()?;
        self.daemon.slots[slot].memory_side(tenant, self.conn_id)?;
        self.first_driver_check();
        let asker = Asker(&self.daemon, &self.peer);
        let timeout = self.daemon.settings().reclaim_timeout;
        self.daemon.slots[slot]
            .charge(tenant, self.conn_id, bytes, timeout, &asker)
            .inspect_err(|e| {
                let reason = e.reason.as_deref().unwrap_or("");
                self.log_refusal("charge refused", slot, bytes, None, reason, &e.message);
            })?;
        Ok(Reply::Ack)
    }

    /// Before a tenant's first grant or charge, the driver's figures are read once more, so that
    /// its CUDA context (made before its first allocation) counts before anything is booked, not
    /// up to a reading period later.
    fn first_driver_check(&mut self) {
        let Some(t) = self.tenant.as_mut() else {
            return;
        };
        if std::mem::replace(&mut t.driver_checked, true) {
            return;
        }
        if let Some(check) = &self.daemon.driver_check {
            check.check(&self.daemon);
        }
    }

    fn send_error(&self, id: u64, code: ErrorCode, message: String) {
        let reply = Reply::Error(ErrorReply {
            code,
            reason: None,
            message,
        });
        let _ = self.peer.conn.send(id, &reply, &[]);
    }

    fn finish(self) {
        self.peer.mark_closed();
        // Descriptors the peer sent that were never read are references to memory too: gone
        // before its memory is counted.
        self.peer.conn.discard_incoming();
        self.daemon.shared.wake_waiters();
        self.daemon
            .conns
            .lock()
            .expect("conns")
            .remove(&self.conn_id);
        let Some(t) = self.tenant else { return };
        if let (Some(m), Some((labels, _))) = (self.daemon.metrics(), &t.grant_seconds) {
            m.forget(labels);
        }
        let started = Instant::now();
        if self.daemon.is_shutting_down() {
            // The daemon is stopping: the state file keeps this tenant and what it holds for the
            // next daemon, to which it reconnects; its memory stays with it meanwhile.
            let _ = self.daemon.slots[t.slot].disconnect(t.id);
            tracing::info!(
                tenant = t.name,
                pid = self.pid,
                gpu = t.slot,
                "daemon stopping: the tenant keeps its memory and reconnects to the next daemon"
            );
            return;
        }
        if t.member {
            let (held, handles) = self.daemon.slots[t.slot].member_gone(t.id);
            tracing::info!(
                tenant = t.name, pid = self.pid, gpu = t.slot, held = %held, handles,
                micros = started.elapsed().as_micros() as u64,
                "tenant's program closed its connection; all it held is back (`vramd run` \
                 reports how it ended)"
            );
            return;
        }
        let Some((state, handles)) = self.daemon.slots[t.slot].disconnect(t.id) else {
            return;
        };
        let micros = started.elapsed().as_micros() as u64;
        let (pid, gpu) = (self.pid, t.slot);
        if let Some(bye) = t.bye {
            tracing::info!(
                tenant = t.name, pid, gpu, held = %bye.held, charged = %bye.charged,
                released = %state.held, handles, micros,
                "tenant finished: it said Bye; what it still held is released"
            );
            return;
        }
        let held = state.held.saturating_add(state.charged);
        // Memory is back already; how the process ended is looked up for the log only.
        let ended = super::exit::how_it_ended(pid, t.start_time);
        let (signal, core, exit_status) = match ended {
            Some(Ended::Signal { signal, core }) => (Some(signal), Some(core), None),
            Some(Ended::Exited(status)) => (None, None, Some(status)),
            None => (None, None, None),
        };
        if held > Bytes::ZERO || handles > 0 || signal.is_some() {
            tracing::warn!(
                tenant = t.name, pid, gpu, reclaimed = %state.held, charged = %state.charged,
                handles, micros, signal, core, exit_status,
                "crash reclaim: tenant gone without Bye; all it held is back"
            );
        } else {
            tracing::info!(
                tenant = t.name,
                pid,
                gpu,
                exit_status,
                "tenant gone holding nothing"
            );
        }
    }
}

/// How a tenant's program ended, as `vramd run` saw it: a normal end is INFO, a signal or a
/// failure exit is a WARN with the signal or code.
/// `more`: earlier reports on this connection not logged (see `Session::reports`).
fn log_exit(tenant: &str, gpu: usize, status: vram_proto::ExitStatus, more: u64) {
    match status {
        vram_proto::ExitStatus::Code(0) => {
            tracing::info!(
                tenant,
                gpu,
                exit_status = 0,
                more,
                "tenant's program finished"
            )
        }
        vram_proto::ExitStatus::Code(code) => {
            tracing::warn!(
                tenant,
                gpu,
                exit_status = code,
                more,
                "tenant's program failed"
            )
        }
        vram_proto::ExitStatus::Signal(signal) => {
            tracing::warn!(
                tenant,
                gpu,
                signal,
                more,
                "tenant's program was killed by a signal"
            )
        }
    }
}

/// The broker's rule a tenant names for its own refusal, from the broker's set; anything else is
/// counted as `other`, so a tenant cannot grow the metrics' label set.
fn refusal_reason(reason: &str) -> &'static str {
    vram_core::broker::GrantError::REASONS
        .into_iter()
        .find(|k| *k == reason)
        .unwrap_or("other")
}

/// Sends reclaim requests to other tenants' connections.
struct Asker<'a>(&'a Daemon, &'a Peer);

impl ReclaimSender for Asker<'_> {
    fn ask(&self, conn: u64, bytes: Bytes) {
        self.0.ask_reclaim(conn, bytes);
    }

    fn settled(&self, satisfied: bool, waited: Duration) {
        let waited_ms = waited.as_secs_f64() * 1e3;
        if satisfied {
            tracing::info!(waited_ms, "reclaim done: enough memory came back");
        } else {
            tracing::warn!(
                waited_ms,
                "reclaim done: not enough memory came back in time"
            );
        }
        if let Some(m) = self.0.metrics() {
            m.reclaim_settled(satisfied);
        }
    }

    fn asker_gone(&self) -> bool {
        self.1.hung_up()
    }
}
