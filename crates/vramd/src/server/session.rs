//! One connection: who the peer is, what it asks, and cleaning up after it whatever way it ends.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::histogram::Histogram;
use vram_core::broker::{TenantId, TenantRequest};
use vram_core::Bytes;
use vram_proto::{Conn, ErrorCode, ErrorReply, Hello, ProtoError, Reply, Request, Role, Welcome};

use super::slot::ReclaimSender;
use super::Daemon;
use crate::metrics::{tenant_labels, TenantLabels};

/// A registered tenant on this connection.
struct Registered {
    slot: usize,
    id: TenantId,
    name: String,
    /// Its grant latency series, when metrics are served.
    grant_seconds: Option<(TenantLabels, Histogram)>,
}

struct Session {
    daemon: Arc<Daemon>,
    conn_id: u64,
    conn: Arc<Conn>,
    pid: u32,
    uid: u32,
    tenant: Option<Registered>,
}

pub fn run(daemon: Arc<Daemon>, conn_id: u64, conn: Arc<Conn>) {
    let creds = match rustix::net::sockopt::socket_peercred(conn.stream()) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("cannot read peer credentials: {e}");
            daemon.conns.lock().expect("conns").remove(&conn_id);
            return;
        }
    };
    let mut session = Session {
        daemon,
        conn_id,
        conn,
        pid: creds.pid.as_raw_nonzero().get() as u32,
        uid: creds.uid.as_raw(),
        tenant: None,
    };
    if session.daemon.uid_allowed(session.uid) {
        session.serve();
    } else {
        tracing::warn!(
            uid = session.uid,
            pid = session.pid,
            "connection refused: uid not allowed"
        );
        let message = format!(
            "uid {} is not allowed to use this vramd (add it to allowed_uids in the daemon's config)",
            session.uid
        );
        session.send_error(0, ErrorCode::PermissionDenied, message);
    }
    session.finish();
}

impl Session {
    fn serve(&mut self) {
        loop {
            let received = match self.conn.recv::<Request>() {
                Ok(r) => r,
                Err(ProtoError::Closed) => return,
                Err(e) => {
                    self.daemon.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pid = self.pid, "protocol error: {e}");
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
            Request::Status => Ok(Reply::Status(Box::new(self.daemon.status()))),
            Request::Ping => Ok(Reply::Pong),
            Request::Grant { bytes } => return self.grant(id, bytes),
            Request::GrantMany { sizes } => return self.grant_many(id, sizes, true),
            Request::Shared(r) => {
                return super::shared::serve(&self.daemon, &self.conn, self.registered(), id, r)
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
                let name = self.tenant.as_ref().map_or("", |t| t.name.as_str());
                tracing::warn!(
                    tenant = name,
                    gpu = slot,
                    asked = bytes.get(),
                    reason,
                    "refused in the tenant's library: {}",
                    message.chars().take(512).collect::<String>()
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
            Request::ReclaimDone { ask, returned } => self.registered().map(|_| {
                let name = self.tenant.as_ref().map_or("", |t| t.name.as_str());
                tracing::info!(tenant = name, ask, %returned, "reclaim answered");
                if let Some(m) = self.daemon.metrics() {
                    m.reclaim_answered(returned.get());
                }
                Reply::Ack
            }),
        };
        let reply = reply.unwrap_or_else(Reply::Error);
        self.conn.send(id, &reply, &[]).is_ok()
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

    fn hello(&mut self, hello: Hello) -> Result<Reply, ErrorReply> {
        if let Some(t) = &self.tenant {
            return Err(ErrorReply {
                code: ErrorCode::NotRegistered,
                reason: None,
                message: format!("this connection is already tenant `{}`", t.name),
            });
        }
        let Role::Tenant {
            name,
            class,
            guarantee,
            limit,
        } = hello.role
        else {
            return Ok(Reply::Ack);
        };
        let slot = hello.gpu.unwrap_or(0) as usize;
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
        };
        let (id, t) = s
            .connect(request, self.conn_id, hello.resume.as_ref())
            .inspect_err(|e| {
                tracing::warn!(pid = self.pid, "tenant refused at connect: {}", e.message);
            })?;
        tracing::info!(
            tenant = t.name, class = t.class, guarantee = %t.guarantee, limit = %t.limit,
            pid = self.pid, gpu = slot, client = hello.client, "tenant connected"
        );
        let grant_seconds = self.daemon.metrics().map(|m| {
            let labels = tenant_labels(&t.name, &t.class, slot as u32);
            (labels.clone(), m.grant_histogram(&labels))
        });
        self.tenant = Some(Registered {
            slot,
            id,
            name: t.name.clone(),
            grant_seconds,
        });
        Ok(Reply::Welcome(Welcome {
            tenant: id.0,
            name: t.name,
            class: t.class,
            priority: t.priority,
            guarantee: t.guarantee,
            limit: t.limit,
            device: s.desc(),
        }))
    }

    fn grant(&mut self, id: u64, bytes: Bytes) -> bool {
        self.grant_many(id, vec![bytes], false)
    }

    /// Grants handles of `sizes`, all or none, and sends them in one reply: `Granted` for a
    /// single `Grant`, else `GrantedMany`.
    fn grant_many(&mut self, id: u64, sizes: Vec<Bytes>, many: bool) -> bool {
        let (slot, tenant) = match self.registered() {
            Ok(r) => r,
            Err(e) => return self.conn.send(id, &Reply::Error(e), &[]).is_ok(),
        };
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
            return self.conn.send(id, &Reply::Error(e), &[]).is_ok();
        }
        let timeout = self.daemon.reclaim_timeout;
        let started = Instant::now();
        let asker = Asker(&self.daemon);
        let granted = match self.daemon.slots[slot].grant_many(tenant, &sizes, timeout, &asker) {
            Ok(g) => g,
            Err(e) => {
                let name = self.tenant.as_ref().map_or("", |t| t.name.as_str());
                tracing::warn!(
                    tenant = name,
                    gpu = slot,
                    asked = sizes.iter().copied().sum::<Bytes>().get(),
                    handles = sizes.len(),
                    reason = e.reason.as_deref().unwrap_or(""),
                    "refused: {}",
                    e.message
                );
                return self.conn.send(id, &Reply::Error(e), &[]).is_ok();
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
        self.conn.send(id, &reply, &fds).is_ok()
    }

    /// Books memory the tenant made itself; refusals are logged as a grant's are.
    fn charge(&self, bytes: Bytes) -> Result<Reply, ErrorReply> {
        let (slot, tenant) = self.registered()?;
        let asker = Asker(&self.daemon);
        let timeout = self.daemon.reclaim_timeout;
        self.daemon.slots[slot]
            .charge(tenant, bytes, timeout, &asker)
            .inspect_err(|e| {
                let name = self.tenant.as_ref().map_or("", |t| t.name.as_str());
                tracing::warn!(
                    tenant = name,
                    gpu = slot,
                    asked = bytes.get(),
                    reason = e.reason.as_deref().unwrap_or(""),
                    "charge refused: {}",
                    e.message
                );
            })?;
        Ok(Reply::Ack)
    }

    fn send_error(&self, id: u64, code: ErrorCode, message: String) {
        let reply = Reply::Error(ErrorReply {
            code,
            reason: None,
            message,
        });
        let _ = self.conn.send(id, &reply, &[]);
    }

    fn finish(self) {
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
        if let Some((state, handles)) = self.daemon.slots[t.slot].disconnect(t.id) {
            let micros = started.elapsed().as_micros() as u64;
            if handles > 0 {
                // It did not give its memory back itself: it crashed, was killed, or just closed.
                tracing::warn!(
                    tenant = t.name, pid = self.pid, reclaimed = %state.held, handles, micros,
                    "crash reclaim: tenant gone holding memory; all of it is back"
                );
            } else {
                tracing::info!(tenant = t.name, pid = self.pid, "tenant gone");
            }
        }
    }
}

/// The broker's rule a tenant names for its own refusal, from the known set; anything else is
/// counted as `other`, so a tenant cannot grow the metrics' label set.
fn refusal_reason(reason: &str) -> &'static str {
    const KNOWN: [&str; 5] = [
        "over_limit",
        "device_full",
        "priority_reserve",
        "bad_size",
        "no_daemon",
    ];
    KNOWN.into_iter().find(|k| *k == reason).unwrap_or("other")
}

/// Sends reclaim requests to other tenants' connections.
struct Asker<'a>(&'a Daemon);

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
}
