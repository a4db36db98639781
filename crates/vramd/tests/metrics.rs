//! The metrics endpoint of a real daemon, scraped while tenant processes take, cache and return
//! memory, checked figure by figure against `vramd status --json`.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

use common::{wait_until, Daemon, VRAMD};
use vram_core::Bytes;
use vram_proto::{StatusReport, TenantStatus};

/// No priority reserve, so that the last free bytes go to whoever asks and reclaim is simple to
/// provoke; metrics on any free loopback port, per tenant.
const CONFIG: &str = r#"
capacity = "4 GiB"
priority_reserve = "0"
metrics = "127.0.0.1:0"
metrics_tenants = true
[pool]
max = "64 MiB"
"#;

/// The address the daemon logged it serves metrics on.
fn metrics_addr(d: &Daemon) -> SocketAddr {
    const MARK: &str = "serving metrics at http://";
    let mut addr = None;
    let found = wait_until(Duration::from_secs(10), || {
        let log = d.log();
        addr = log.split_once(MARK).and_then(|(_, rest)| {
            rest.split_once("/metrics")
                .and_then(|(a, _)| a.parse().ok())
        });
        addr.is_some()
    });
    assert!(found, "no metrics address in the log:\n{}", d.log());
    addr.unwrap()
}

/// A plain HTTP/1.1 GET: status code and body.
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    let code = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap();
    (code, body.to_string())
}

/// Series (name and labels, as written) to value.
fn scrape(addr: SocketAddr) -> BTreeMap<String, f64> {
    let (code, body) = get(addr, "/metrics");
    assert_eq!(code, 200, "{body}");
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            (series.to_string(), value.parse().unwrap())
        })
        .collect()
}

/// What `vramd status --json` prints.
fn status_json(d: &Daemon) -> StatusReport {
    let out = Command::new(VRAMD)
        .args(["status", "--json", "--socket"])
        .arg(&d.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

fn tenant_series(name: &str, t: &TenantStatus) -> String {
    format!(
        "vramd_{name}{{tenant=\"{}\",class=\"{}\",gpu=\"{}\"}}",
        t.name, t.class, t.gpu
    )
}

/// Every per-device and per-tenant figure of the status is in the scrape, with the same value.
fn assert_matches(m: &BTreeMap<String, f64>, s: &StatusReport) {
    let get = |k: &str| {
        *m.get(k)
            .unwrap_or_else(|| panic!("no series {k} in the scrape: {m:#?}"))
    };
    for d in &s.devices {
        let l = format!("{{gpu=\"{}\",uuid=\"{}\"}}", d.index, d.uuid);
        for (name, v) in [
            ("device_capacity_bytes", d.capacity),
            ("device_held_bytes", d.held),
            ("device_pooled_bytes", d.pooled),
            ("device_reserved_bytes", d.reserved),
            ("device_free_bytes", d.free),
            ("device_used_bytes", d.device_used),
        ] {
            assert_eq!(get(&format!("vramd_{name}{l}")), v.get() as f64, "{name}");
        }
        for (source, n) in [
            ("hit", d.pool.hits),
            ("recycled", d.pool.recycled),
            ("miss", d.pool.misses),
        ] {
            let k = format!(
                "vramd_pool_takes_total{{gpu=\"{}\",uuid=\"{}\",source=\"{source}\"}}",
                d.index, d.uuid
            );
            assert_eq!(get(&k), n as f64, "{k}");
        }
    }
    for t in &s.tenants {
        for (name, v) in [
            ("tenant_guarantee_bytes", t.guarantee.get()),
            ("tenant_limit_bytes", t.limit.get()),
            ("tenant_held_bytes", t.held.get()),
            ("tenant_in_use_bytes", t.in_use.get()),
            ("tenant_cached_bytes", t.cached.get()),
            ("tenant_handles", t.handles),
            ("tenant_grants_total", t.grants),
            ("tenant_returns_total", t.returns),
        ] {
            assert_eq!(get(&tenant_series(name, t)), v as f64, "{} {name}", t.name);
        }
        for (reason, n) in &t.refusals {
            let k = format!(
                "vramd_tenant_refusals_total{{tenant=\"{}\",class=\"{}\",gpu=\"{}\",reason=\"{reason}\"}}",
                t.name, t.class, t.gpu
            );
            assert_eq!(get(&k), *n as f64, "{k}");
        }
        // Every grant since it connected was timed.
        let count = tenant_series("tenant_grant_duration_seconds_count", t);
        assert_eq!(get(&count), t.grants as f64, "{count}");
    }
    // Every grant took one handle from somewhere (tenants gone since are not listed).
    let takes: u64 = s
        .devices
        .iter()
        .map(|d| d.pool.hits + d.pool.recycled + d.pool.misses)
        .sum();
    let grants: u64 = s.tenants.iter().map(|t| t.grants).sum();
    assert!(takes >= grants, "{takes} handles taken for {grants} grants");
    assert_eq!(get("vramd_tenants"), s.tenants.len() as f64);
    assert_eq!(
        get("vramd_protocol_errors_total"),
        s.daemon.protocol_errors as f64
    );
}

/// Every `vramd_*` series the shipped Grafana dashboard queries is one the daemon serves (a
/// renamed metric must not leave a panel empty).
fn assert_dashboard_series_exist(m: &BTreeMap<String, f64>) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana-dashboard.json"
    );
    let dashboard = std::fs::read_to_string(path).unwrap();
    let served: std::collections::BTreeSet<&str> = m
        .keys()
        .map(|k| k.split_once('{').map_or(k.as_str(), |(name, _)| name))
        .collect();
    let mut queried = std::collections::BTreeSet::new();
    for (i, _) in dashboard.match_indices("vramd_") {
        let name: String = dashboard[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        queried.insert(name);
    }
    assert!(queried.len() > 10, "{queried:?}");
    let missing: Vec<&String> = queried
        .iter()
        .filter(|q| !served.contains(q.as_str()))
        .collect();
    assert!(missing.is_empty(), "queried, not served: {missing:?}");
}

fn tenant<'a>(s: &'a StatusReport, name: &str) -> &'a TenantStatus {
    s.tenants.iter().find(|t| t.name == name).unwrap()
}

#[test]
fn scraped_figures_match_status_while_tenants_take_and_return() {
    let d = Daemon::start(CONFIG);
    let addr = metrics_addr(&d);
    assert_eq!(get(addr, "/healthz"), (200, "ok\n".to_string()));
    assert_eq!(get(addr, "/nothing").0, 404);
    let m = scrape(addr);
    assert_eq!(m["vramd_reclaim_outcomes_total{outcome=\"short\"}"], 0.0);
    assert_eq!(m["vramd_tenants"], 0.0);

    let mut alpha = d.tenant("alpha", &["--limit", "4GiB"]);
    let mut beta = d.tenant("beta", &["--limit", "1GiB", "--guarantee", "256MiB"]);
    let mut churn = d.tenant("churn", &["--limit", "64MiB"]);
    churn.send("cycles 400 2MiB");

    // Scrapes while `churn` takes and returns: every scrape parses, and its figures lie between
    // the status read before and the one read after.
    for _ in 0..5 {
        let before = d.status();
        let m = scrape(addr);
        let after = d.status();
        let (b, a) = (tenant(&before, "churn"), tenant(&after, "churn"));
        let scraped = m[&tenant_series("tenant_grants_total", a)];
        assert!(
            (b.grants as f64..=a.grants as f64).contains(&scraped),
            "{} <= {scraped} <= {}",
            b.grants,
            a.grants
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(churn.next()["errors"], 0);

    // alpha holds 3.5 GiB; beta fills the device and is refused (nothing is idle to reclaim).
    assert_eq!(alpha.cmd("take 3584MiB 256MiB")["event"], "took");
    let took = beta.cmd("take 1GiB 256MiB");
    let reason = took["refused"]["reason"]
        .as_str()
        .expect("refused")
        .to_string();
    assert_eq!(beta.cmd("give 256MiB")["event"], "gave");
    let s = status_json(&d);
    assert_eq!(tenant(&s, "beta").refusals[&reason], 1, "{took}");
    assert_matches(&scrape(addr), &s);

    // alpha marks 1 GiB idle; beta grows into it: the daemon asks alpha, and alpha gives it back.
    assert_eq!(alpha.cmd("cache 1GiB")["bytes"], 1u64 << 30);
    let took = beta.cmd("take 768MiB 256MiB");
    assert!(took["refused"].is_null(), "{took}");
    let m = scrape(addr);
    assert!(m["vramd_reclaim_requests_total"] >= 1.0, "{m:#?}");
    assert!(m["vramd_reclaim_answers_total"] >= 1.0, "{m:#?}");
    assert!(m["vramd_reclaim_returned_bytes_total"] >= (256u64 << 20) as f64);
    assert!(m["vramd_reclaim_outcomes_total{outcome=\"satisfied\"}"] >= 1.0);
    let s = status_json(&d);
    assert!(tenant(&s, "alpha").returns >= 1);
    let m = scrape(addr);
    assert_matches(&m, &s);
    assert_dashboard_series_exist(&m);

    // /status, to a local user the daemon allows, is the same document as `vramd status
    // --json`, less what moves by itself.
    let (code, body) = get(addr, "/status");
    assert_eq!(code, 200);
    let mut http: StatusReport = serde_json::from_str(&body).unwrap();
    let mut cli = status_json(&d);
    for r in [&mut http, &mut cli] {
        r.daemon.uptime_seconds = 0.0;
        r.daemon.connections = 0;
    }
    assert_eq!(http, cli);

    // A tenant that leaves takes its series with it.
    alpha.exit();
    churn.exit();
    // The daemon notices a closed socket on its own schedule: wait for it, then scrape.
    let gone = wait_until(Duration::from_secs(5), || d.status().tenants.len() == 1);
    assert!(gone, "{:#?}", d.status().tenants);
    let m = scrape(addr);
    assert!(!m.keys().any(|k| k.contains("tenant=\"alpha\"")), "{m:#?}");
    assert_eq!(m["vramd_tenants"], 1.0);
    assert_matches(&m, &status_json(&d));
    beta.exit();
    d.stop();
}

#[test]
fn metrics_off_serves_nothing_and_a_taken_address_is_an_error() {
    let d = Daemon::start(&CONFIG.replace("127.0.0.1:0", "off"));
    assert!(!d.log().contains("serving metrics"), "{}", d.log());
    d.stop();

    // An address asked for explicitly must be served: a daemon that cannot bind it refuses to
    // start.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(VRAMD)
        .args([
            "serve",
            "--backend",
            "host",
            "--capacity",
            "1GiB",
            "--socket",
        ])
        .arg(dir.path().join("s.sock"))
        .arg("--metrics")
        .arg(busy.local_addr().unwrap().to_string())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot listen for metrics"), "{err}");
}

/// The shared-buffer series against `vramd status --json`: a publish, a writer conflict, and a
/// byte flipped behind the daemon's back that the scrub finds.
#[test]
fn shared_buffer_series_match_status() {
    use vram_client::{Acl, Client, ClientError, Principal, TenantOptions};

    let d = Daemon::start(&format!("{CONFIG}[shared]\nscrub_rate = \"256 MiB\"\n"));
    let addr = metrics_addr(&d);
    let m = scrape(addr);
    for k in [
        "vramd_shared_publishes_total",
        "vramd_shared_conflicts_total",
        "vramd_shared_leases_expired_total",
        "vramd_shared_scrub_bytes_total",
        "vramd_shared_scrub_mismatches_total",
    ] {
        assert_eq!(m.get(k), Some(&0.0), "{k}: {m:#?}");
    }
    assert_eq!(
        m["vramd_shared_scrub_rate_bytes_per_second"],
        (256u64 << 20) as f64
    );

    let owner = Client::connect(Some(&d.socket), &TenantOptions::named("trainer")).unwrap();
    let other = Client::connect(Some(&d.socket), &TenantOptions::named("other")).unwrap();
    let acl = Acl {
        readers: vec![Principal::Anyone],
        writers: vec![Principal::Anyone],
    };
    let size = Bytes::mib(4);
    let buf = owner.create_shared("weights", size, acl).unwrap();
    let lease = buf.lease(Duration::from_secs(10)).unwrap();
    let draft = lease.begin_write(None).unwrap();
    draft
        .write(Bytes::ZERO, &vec![7u8; size.get() as usize])
        .unwrap();
    draft.publish_keeping_mapping().unwrap();
    let pinned = buf.pin().unwrap();
    // A second writer while the lease is held: a conflict.
    let theirs = other.open_shared("weights").unwrap();
    assert!(matches!(
        theirs.lease(Duration::from_secs(10)),
        Err(ClientError::Daemon(ref r)) if r.code == vram_proto::ErrorCode::Conflict
    ));
    // The writer's mapping outlived its publish: flip one byte of the published version.
    draft.write(Bytes(12_345), &[8]).unwrap();
    let found = wait_until(Duration::from_secs(5), || {
        d.status().shared.scrub.mismatches >= 1
    });
    assert!(found, "the scrub never noticed:\n{}", d.log());

    // The scrub goes on (and finds the same version again at each pass): its counters lie
    // between the status read before the scrape and the one read after.
    let before = status_json(&d);
    let m = scrape(addr);
    let after = status_json(&d);
    let within = |k: &str, b: u64, a: u64| {
        let v = m[k];
        assert!((b as f64..=a as f64).contains(&v), "{k}: {b} <= {v} <= {a}");
    };
    within(
        "vramd_shared_scrub_mismatches_total",
        before.shared.scrub.mismatches,
        after.shared.scrub.mismatches,
    );
    within(
        "vramd_shared_scrub_bytes_total",
        before.shared.scrub.bytes,
        after.shared.scrub.bytes,
    );
    assert!(m["vramd_shared_scrub_mismatches_total"] >= 1.0);
    let s = &after.shared;
    assert_eq!(s.publishes, 1);
    assert_eq!(m["vramd_shared_publishes_total"], s.publishes as f64);
    assert_eq!(
        m["vramd_shared_publish_bytes_total"],
        s.publish_bytes as f64
    );
    assert!(s.conflicts >= 1);
    assert_eq!(m["vramd_shared_conflicts_total"], s.conflicts as f64);
    assert_eq!(
        m["vramd_shared_leases_expired_total"],
        s.leases_expired as f64
    );
    let dev = &after.devices[0];
    let l = format!("{{gpu=\"{}\",uuid=\"{}\"}}", dev.index, dev.uuid);
    let info = &s.buffers[0].info;
    assert_eq!(m[&format!("vramd_shared_buffers{l}")], 1.0);
    assert_eq!(
        m[&format!("vramd_shared_versions{l}")],
        info.versions as f64
    );
    assert_eq!(
        m[&format!("vramd_shared_bytes{l}")],
        info.bytes.get() as f64
    );
    assert_eq!(m[&format!("vramd_shared_pins{l}")], info.pins as f64);
    assert_eq!(m[&format!("vramd_shared_corrupt_versions{l}")], 1.0);
    assert_eq!(info.corrupt, vec![pinned.version()]);

    drop(pinned);
    drop(draft);
    drop(lease);
    drop(theirs);
    d.stop();
}

#[test]
fn without_the_operators_word_metrics_and_status_name_no_tenant() {
    let config = CONFIG
        .replace("metrics_tenants = true", "http_status = \"any\"")
        .replace("[pool]", "[classes.batch]\npriority = 20\n[pool]");
    let d = Daemon::start(&config);
    let addr = metrics_addr(&d);
    let secret = d.tenant("secret-project", &["--class", "batch"]);
    let other = d.tenant("other-project", &["--class", "batch"]);
    let mut s = secret;
    s.cmd("take 64MiB");
    let m = scrape(addr);
    assert!(!m.keys().any(|k| k.contains("project")), "{m:#?}");
    let held = m
        .iter()
        .find(|(k, _)| k.starts_with("vramd_tenant_held") && k.contains("class=\"batch\""))
        .map(|(_, v)| *v);
    assert_eq!(
        held,
        Some(Bytes::mib(64).get() as f64),
        "summed by class: {m:#?}"
    );

    let (code, body) = get(addr, "/status");
    assert_eq!(code, 200);
    assert!(!body.contains("project"), "{body}");
    let http: StatusReport = serde_json::from_str(&body).unwrap();
    assert_eq!(http.tenants.len(), 1, "one line per class: {body}");
    assert_eq!(http.tenants[0].held, Bytes::mib(64));
    assert_eq!(http.tenants[0].pid, 0);
    s.exit();
    other.exit();
    d.stop();
}

#[test]
fn status_over_http_is_for_the_daemons_own_users_by_default() {
    let config = CONFIG.replace("metrics_tenants = true", "allowed_uids = [4242]");
    let d = Daemon::start(&config);
    let addr = metrics_addr(&d);
    let (code, body) = get(addr, "/status");
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("is not in allowed_uids [4242]"), "{body}");
    let (code, _) = get(addr, "/metrics");
    assert_eq!(code, 200);
    d.stop();
}

/// A client that sends half a request and waits holds neither the endpoint nor the daemon's
/// stop: other clients are served beside it, and SIGTERM still ends the daemon within its 10 s.
#[test]
fn a_half_sent_request_holds_neither_scrapes_nor_the_stop() {
    let d = Daemon::start(CONFIG);
    let addr = metrics_addr(&d);
    let mut half = TcpStream::connect(addr).unwrap();
    write!(half, "GET /metrics HTTP/1.1\r\n").unwrap();
    let (code, body) = get(addr, "/healthz");
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    d.stop();
    drop(half);
}

/// A tenant's answer to a reclaim ask it was never sent counts for nothing: the reclaim series
/// are the daemon's asks and what their answers say, not whatever a tenant sends.
#[test]
fn an_answer_to_no_reclaim_ask_is_not_counted() {
    use vram_proto::{Conn, Hello, Reply, Request, Role};

    let d = Daemon::start(CONFIG);
    let addr = metrics_addr(&d);
    let conn = Conn::new(std::os::unix::net::UnixStream::connect(&d.socket).unwrap());
    let hello = Hello {
        role: Role::Tenant {
            name: "boaster".into(),
            class: None,
            guarantee: None,
            limit: None,
        },
        gpu: None,
        client: "metrics test".into(),
        resume: None,
    };
    conn.send(1, &Request::Hello(hello), &[]).unwrap();
    assert!(matches!(
        conn.recv::<Reply>().unwrap().msg,
        Reply::Welcome(_)
    ));
    for (id, ask) in [(2, 7), (3, 7), (4, 0)] {
        let done = Request::ReclaimDone {
            ask,
            returned: Bytes(u64::MAX),
        };
        conn.send(id, &done, &[]).unwrap();
        assert_eq!(conn.recv::<Reply>().unwrap().msg, Reply::Ack);
    }
    let m = scrape(addr);
    let reclaim: Vec<_> = m
        .iter()
        .filter(|(k, _)| k.contains("reclaim_answers") || k.contains("reclaim_returned"))
        .collect();
    assert!(!reclaim.is_empty(), "{m:#?}");
    assert!(reclaim.iter().all(|(_, v)| **v == 0.0), "{reclaim:?}");
    drop(conn);
    d.stop();
}
