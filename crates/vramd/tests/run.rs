//! `vramd run`: the program gets the tenant's settings, its exit status is ours, signals reach
//! it, and a Python program that imports torch gets vramd's allocator installed (a stand-in
//! `torch` package here, since PyTorch and a GPU are not needed to check the wiring).

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{library, wait_until, Daemon, VRAMD};
use vram_core::Bytes;

const CONFIG: &str = "capacity = \"8 GiB\"\n";

fn vramd_run(d: &Daemon, flags: &[&str], program: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(VRAMD);
    cmd.arg("run")
        .arg("--socket")
        .arg(&d.socket)
        .args(flags)
        .arg("--")
        .args(program);
    if library().is_none() {
        // Any file will do for the checks that do not load it.
        cmd.env("VRAMD_LIB", VRAMD);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::null()).output().unwrap()
}

#[test]
fn the_tenant_is_registered_before_the_program_runs_and_its_exit_status_is_ours() {
    let d = Daemon::start(CONFIG);
    // The program never allocates: the tenant shows all the same, with its settings.
    let script = "import os, sys, time; \
        print(bool(os.environ.get('VRAMD_JOIN')), os.environ.get('VRAMD_TENANT'), \
        os.environ.get('VRAMD_TORCH_MODE'), flush=True); \
        time.sleep(1); import vramd_torch; print(vramd_torch.installed()); sys.exit(7)";
    let mut cmd = Command::new(VRAMD);
    cmd.args(["run", "--socket"])
        .arg(&d.socket)
        .args([
            "--tenant",
            "t1",
            "--limit",
            "2GiB",
            "--guarantee",
            "1GiB",
            "--gpu",
            "0",
        ])
        .args(["--torch-mode", "full", "--", "python3", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if library().is_none() {
        cmd.env("VRAMD_LIB", VRAMD);
    }
    let child = cmd.spawn().unwrap();
    assert!(wait_until(Duration::from_secs(10), || {
        d.status()
            .tenants
            .iter()
            .any(|t| t.name == "t1" && t.limit == Bytes::gib(2) && t.guarantee == Bytes::gib(1))
    }));
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The settings travel through the registration, not as variables.
    assert_eq!(stdout.lines().next(), Some("True None full"));
    assert_eq!(
        stdout.lines().nth(1),
        Some("None"),
        "no torch imported, nothing installed"
    );
    d.wait_for_no_tenants();
}

#[test]
fn what_cannot_work_stops_before_the_program_starts() {
    let d = Daemon::start(CONFIG);
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let program = ["touch", marker.to_str().unwrap()];
    // (flags, environment, what the error must say)
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec!["--class", "nonsense"],
            vec![],
            "unknown class `nonsense`",
        ),
        (
            vec![],
            vec![("VRAMD_PRIORITY", "high")],
            "VRAMD_PRIORITY was renamed VRAMD_CLASS",
        ),
        (
            vec!["--guarantee", "64GiB"],
            vec![],
            "asks for a guarantee of 64 GiB",
        ),
        (
            vec!["--limit", "8"],
            vec![],
            "asks for a limit of 8 B, below the device's granularity (2 MiB)",
        ),
        (
            vec![],
            vec![("VRAMD_ALLOC", "min_grow=banana")],
            "VRAMD_ALLOC",
        ),
    ];
    for (flags, env, says) in cases {
        let mut cmd = Command::new(VRAMD);
        cmd.args(["run", "--socket"])
            .arg(&d.socket)
            .args(&flags)
            .arg("--")
            .args(program)
            .envs(env.iter().copied())
            .env("VRAMD_LIB", library().unwrap_or_else(|| VRAMD.into()));
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "{flags:?}: {stderr}");
        assert!(stderr.contains(says), "{flags:?}: {stderr}");
        assert!(!marker.exists(), "{flags:?}: the program ran");
    }
    // A name already in use, and a daemon that is not there.
    let _holder = d.tenant("taken", &[]);
    let out = vramd_run(&d, &["--tenant", "taken"], &program, &[]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("already connected"));
    let out = Command::new(VRAMD)
        .args(["run", "--socket", "/nonexistent/vramd.sock", "--"])
        .args(program)
        .env("VRAMD_LIB", library().unwrap_or_else(|| VRAMD.into()))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach vramd"));
    assert!(!marker.exists(), "the program ran");
}

#[test]
fn a_missing_program_is_an_error_and_signals_reach_the_program() {
    let d = Daemon::start(CONFIG);
    let out = vramd_run(&d, &[], &["/nonexistent/program"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot start"));

    let mut child = Command::new(VRAMD)
        .arg("run")
        .arg("--socket")
        .arg(&d.socket)
        .args(["--", "sleep", "30"])
        .env("VRAMD_LIB", library().unwrap_or_else(|| VRAMD.into()))
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(128 + 15),
        "the program was terminated by our SIGTERM"
    );
}

/// A program started under `nohup` (SIGHUP ignored) keeps ignoring it under `vramd run`: a
/// signal `vramd run` caught would be the program's default again at its exec.
#[test]
fn a_signal_ignored_at_start_stays_ignored_in_the_program() {
    let d = Daemon::start(CONFIG);
    let lib = library().unwrap_or_else(|| VRAMD.into());
    let out = Command::new("sh")
        .arg("-c")
        .arg(r#"trap "" HUP; exec "$0" run --socket "$1" -- sh -c 'kill -HUP $$; echo alive'"#)
        .arg(VRAMD)
        .arg(&d.socket)
        .env("VRAMD_LIB", &lib)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).trim()
        ),
        (Some(0), "alive"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// SIGINT sent to `vramd run` by another process reaches the program, whether or not standard
/// input is a terminal (only a terminal's own Ctrl-C, which the program gets itself, is not
/// passed on).
#[test]
fn a_sigint_sent_by_a_process_reaches_the_program_under_a_terminal() {
    let d = Daemon::start(CONFIG);
    let (master, slave) = common::pty();
    let mut child = Command::new(VRAMD)
        .arg("run")
        .arg("--socket")
        .arg(&d.socket)
        .args(["--", "sh", "-c", "trap 'exit 5' INT; sleep 10 & wait"])
        .env("VRAMD_LIB", library().unwrap_or_else(|| VRAMD.into()))
        .stdin(Stdio::from(slave))
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
    let ended = wait_until(Duration::from_secs(5), || {
        child.try_wait().unwrap().is_some()
    });
    if !ended {
        let _ = child.kill();
    }
    assert!(ended, "the program did not get the SIGINT");
    assert_eq!(child.wait().unwrap().code(), Some(5));
    drop(master);
}

/// A daemon that stops answering while the program runs does not hold up `vramd run`'s exit: the
/// program's end is told to it in passing.
#[test]
fn a_daemon_that_stopped_answering_does_not_hold_up_the_exit() {
    let d = Daemon::start(CONFIG);
    let mut child = Command::new(VRAMD)
        .arg("run")
        .arg("--socket")
        .arg(&d.socket)
        .args(["--", "sh", "-c", "echo started; sleep 1"])
        .env("VRAMD_LIB", library().unwrap_or_else(|| VRAMD.into()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // The program runs once the registration is done: only its end is told the daemon now.
    let mut started = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut started,
    )
    .unwrap();
    assert_eq!(started.trim(), "started");
    let daemon = rustix::process::Pid::from_raw(d.pid() as i32).unwrap();
    rustix::process::kill_process(daemon, rustix::process::Signal::STOP).unwrap();
    let ended = wait_until(Duration::from_secs(15), || {
        child.try_wait().unwrap().is_some()
    });
    rustix::process::kill_process(daemon, rustix::process::Signal::CONT).unwrap();
    if !ended {
        let _ = child.kill();
    }
    assert!(ended, "vramd run waited on the stopped daemon");
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

/// A stand-in `torch`: just what `vramd_torch.install(mode="pool")` touches before CUDA starts.
const FAKE_TORCH: &str = include_str!("fake_torch/torch/__init__.py");

#[test]
fn importing_torch_installs_the_allocator_and_mem_get_info_shows_the_tenant_view() {
    let Some(lib) = library() else {
        eprintln!("skipped: libvram.so is not next to vramd (cargo build -p vram-ffi)");
        return;
    };
    let d = Daemon::start(CONFIG);
    let fake = tempfile::tempdir().unwrap();
    std::fs::create_dir(fake.path().join("torch")).unwrap();
    std::fs::write(fake.path().join("torch/__init__.py"), FAKE_TORCH).unwrap();
    let script = "import sys; sys.path.append(sys.argv[1]); import torch, vramd_torch; \
        print(vramd_torch.installed()); print(*torch.cuda.mem_get_info()); \
        print(torch.cuda._lazy_init is not sys.modules['torch.cuda']._lazy_init or 'patched'); \
        print('interposing', vramd_torch._lib.lib().vram_interposing())";
    let out = vramd_run(
        &d,
        &["--tenant", "py", "--limit", "1GiB", "--torch-mode", "pool"],
        &["python3", "-c", script, fake.path().to_str().unwrap()],
        &[("VRAMD_LIB", &lib)],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "pool");
    assert_eq!(
        lines[1],
        format!("{0} {0}", 1u64 << 30),
        "free = limit - held, total = limit"
    );
    assert_eq!(
        lines[3], "interposing 1",
        "the CUDA runtime's cudaMalloc is libvram.so's"
    );
}

#[test]
fn pool_mode_empties_pytorchs_cache_when_the_daemon_asks_for_memory() {
    use std::io::{BufRead, BufReader};
    let Some(lib) = library() else {
        eprintln!("skipped: libvram.so is not next to vramd (cargo build -p vram-ffi)");
        return;
    };
    let d =
        Daemon::start("capacity = \"1 GiB\"\npriority_reserve = \"0\"\n[pool]\nmax = \"64 MiB\"\n");
    let fake = tempfile::tempdir().unwrap();
    std::fs::create_dir(fake.path().join("torch")).unwrap();
    std::fs::write(fake.path().join("torch/__init__.py"), FAKE_TORCH).unwrap();
    // The program takes 768 MiB through the CUDA runtime's cudaMalloc (libvram's, preloaded) and
    // frees it, as PyTorch's caching allocator does with a segment; then it waits, doing nothing,
    // for vramd's thread to empty "PyTorch's" cache.
    let script = r#"
import sys, ctypes, time
sys.path.append(sys.argv[1])
import torch, vramd_torch
emptied = []
torch.cuda.empty_cache = lambda: emptied.append(time.time())
lib = vramd_torch._lib.lib()
p = ctypes.c_void_p()
assert lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(768 << 20)) == 0, "cudaMalloc"
assert lib.cudaFree(p) == 0, "cudaFree"
print("ready", flush=True)
deadline = time.time() + 20
while not emptied and time.time() < deadline:
    time.sleep(0.01)
print("emptied" if emptied else "not emptied", flush=True)
"#;
    let mut child = Command::new(VRAMD)
        .arg("run")
        .arg("--socket")
        .arg(&d.socket)
        .args(["--tenant", "py", "--torch-mode", "pool", "--"])
        .args(["python3", "-c", script, fake.path().to_str().unwrap()])
        .env("VRAMD_LIB", &lib)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = || lines.next().and_then(Result::ok).unwrap_or_default();
    assert_eq!(next(), "ready");
    let idle = |d: &Daemon| {
        d.status()
            .tenants
            .iter()
            .find(|t| t.name == "py")
            .is_some_and(|t| t.cached.get() >= 512 << 20)
    };
    assert!(
        wait_until(Duration::from_secs(10), || idle(&d)),
        "the program's idle memory never showed in the daemon's status: {:?}",
        d.status()
    );
    // Another tenant needs what the program keeps idle: the daemon asks the program for it.
    let mut beta = d.tenant("beta", &[]);
    let took = beta.cmd("take 512MiB 256MiB");
    assert!(took["refused"].is_null(), "{took}");
    assert_eq!(
        next(),
        "emptied",
        "vramd's thread in the program saw the request"
    );
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    beta.exit();
}

#[test]
fn a_nested_run_chains_to_the_users_sitecustomize_once() {
    let d = Daemon::start(CONFIG);
    // The user's own sitecustomize, which vramd's must run after itself, once.
    let user = tempfile::tempdir().unwrap();
    std::fs::write(
        user.path().join("sitecustomize.py"),
        "print('user sitecustomize', flush=True)\n",
    )
    .unwrap();
    let socket = d.socket.to_str().unwrap();
    let inner = [
        VRAMD,
        "run",
        "--socket",
        socket,
        "--tenant",
        "inner",
        "--",
        "python3",
        "-c",
        "print('ran', flush=True)",
    ];
    let out = vramd_run(
        &d,
        &["--tenant", "outer"],
        &inner,
        &[("PYTHONPATH", user.path())],
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(!stderr.contains("sitecustomize"), "{stderr}");
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        ["user sitecustomize", "ran"]
    );
}

#[test]
fn the_sitecustomize_hooks_torch_only_under_vramd_run() {
    // python/ put on PYTHONPATH by hand (to import the `vramd` package, say) carries no torch mode:
    // vramd's sitecustomize then leaves PyTorch alone; with the mode `vramd run` sets, it hooks it.
    let python = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python");
    let hooked = |mode: Option<&str>| {
        let mut cmd = std::process::Command::new("python3");
        cmd.args([
            "-c",
            "import sys; print(any(type(f).__name__ == '_Finder' for f in sys.meta_path))",
        ])
        .env("PYTHONPATH", &python)
        .env_remove("VRAMD_TORCH_MODE");
        if let Some(mode) = mode {
            cmd.env("VRAMD_TORCH_MODE", mode);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && stderr.is_empty(), "{stderr}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(hooked(None), "False");
    assert_eq!(hooked(Some("full")), "True");
}

#[test]
fn the_program_joins_the_run_and_a_process_given_a_name_is_a_tenant_of_its_own() {
    assert!(library().is_some(), "libvram.so could not be built");
    let d = Daemon::start(CONFIG);
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python");
    // The first process connects with nothing asked: the run's tenant, with its limit. A second
    // one named by VRAMD_TENANT is its own tenant; a third, unnamed, is refused, told why.
    let script = "python3 -c 'import vramd; t = vramd.connect(); print(t.name, t.limit)' && \
        VRAMD_TENANT=kid python3 -c 'import vramd; t = vramd.current(); t.alloc(2 << 20); \
        print(t.name)' && \
        python3 -c 'import vramd; vramd.current().alloc(2 << 20)'";
    let out = vramd_run(
        &d,
        &["--tenant", "jt", "--limit", "1GiB"],
        &["sh", "-c", script],
        &[("PYTHONPATH", &python)],
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        ["jt 1073741824", "kid"],
        "{stderr}"
    );
    assert!(!out.status.success());
    assert!(
        stderr.contains("no such invitation") && stderr.contains("VRAMD_TENANT"),
        "{stderr}"
    );
}

/// The Python package's `Tenant` after `close`: an error, not a new tenant made behind its back
/// by libvram.so's first use (which no `close` of that object would end); its blocks are on the
/// tenant's GPU whatever number the daemon gives it (`VRAM_TENANT_DEVICE`); a size beyond what
/// the C ABI takes is an error, not wrapped around to a small one.
#[test]
fn a_python_tenant_used_after_close_is_an_error_and_makes_no_tenant() {
    let d = Daemon::start(CONFIG);
    let script = "import vramd\n\
        t = vramd.connect(name='closing', limit='64MiB')\n\
        try:\n    t.alloc((1 << 64) + (1 << 20))\n    print('allocated')\n\
        except ValueError as e:\n    print(e)\n\
        p = t.alloc(2 << 20)\n\
        t.free(p)\n\
        t.close()\n\
        try:\n    t.name\n    print('no error')\n\
        except vramd.VramdError as e:\n    print('closed:', e)\n\
        print(sorted(x['name'] for x in vramd.status()['tenants']))\n";
    assert_eq!(
        python_lines(&d, script, &[]),
        [
            "vramd: 18446744073710600192 is more bytes than any device has",
            "closed: vramd: this tenant was closed; vramd.connect() makes a new one",
            "[]"
        ]
    );
}

/// What the Python package leaves behind cannot hold a tenant or make one: a `Tenant` object of
/// a tenant another object closed is closed too; a shared buffer dropped without `close` ends
/// its handle, so that the tenant can end; `vram_trim` in a process that is no tenant makes
/// none; a Ray task's tenant starts in a worker that became a tenant outside any task (the first
/// use of a task that asked for nothing) by ending that one; an ask of no memory is an error, and
/// the library's path handed to Ray's workers is absolute.
#[test]
fn the_python_package_leaves_no_tenant_behind_and_ends_any_it_finds() {
    let d = Daemon::start(CONFIG);
    let script = "import gc, os, vramd, vramd.ray as vr\n\
        os.environ['VRAMD_LIB'] = os.path.relpath(os.environ['VRAMD_LIB'])\n\
        print(os.path.isabs(vramd._lib.path()))\n\
        print(vramd._lib.lib().vram_trim(), vramd.status()['tenants'])\n\
        a = vramd.connect(name='first', limit='64MiB')\n\
        b = vramd.current()\n\
        def dropped():\n    vramd.SharedBuffer.create('dropped', 2 << 20)\n\
        dropped()\n\
        gc.collect()\n\
        a.close()\n\
        try:\n    b.alloc(1 << 20)\n    print('allocated')\n\
        except vramd.VramdError as e:\n    print(e)\n\
        print(vramd.status()['tenants'])\n\
        vramd.current()\n\
        with vr.task_tenant('task') as t:\n    print(t.name)\n\
        print(vramd.status()['tenants'])\n\
        try:\n    vr.options(memory=0, limit='1GiB')\n\
        except ValueError as e:\n    print(str(e)[:40])\n";
    assert_eq!(
        python_lines(&d, script, &[]),
        [
            "True",
            "0 []",
            "vramd: this tenant was closed; vramd.connect() makes a new one",
            "[]",
            "task",
            "[]",
            "vramd: memory=0 asks Ray for none of vra",
        ]
    );
}

/// The Python package refuses a library that is not a libvram.so of its C ABI, with the reason,
/// before calling anything of it; the right one then loads.
#[test]
fn the_python_package_refuses_a_library_of_another_abi() {
    let d = Daemon::start(CONFIG);
    let script = "import _ctypes, vramd\n\
        try:\n    vramd.load(_ctypes.__file__)\n\
        except RuntimeError as e:\n    print(str(e).replace(_ctypes.__file__, 'P'))\n\
        vramd.load()\n\
        print(vramd._lib.lib().vram_abi_version() == vramd._lib.ABI_VERSION)\n";
    assert_eq!(
        python_lines(&d, script, &[]),
        [
            "vramd: P has no vram_abi_version: it is not a libvram.so this package can use (it \
             needs C ABI 2); use the libvram.so built with this package (the same vramd release)",
            "True"
        ]
    );
}

/// A pinned version read through the Python package's `Pin.view`: a slice of a view outlives
/// the pin's `release` and the buffer's `close` and still reads the version (the memory stays
/// mapped until nothing made from a view is left), then the tenant ends cleanly. A pin whose
/// views are gone does not hold its buffer's close back, and is released by it; a wait with
/// nothing newer ends at its timeout.
#[test]
fn a_python_pins_view_outlives_its_release_and_reads_the_version() {
    let d = Daemon::start(CONFIG);
    let script = "import ctypes, gc, vramd\n\
        t = vramd.connect(name='pins', limit='64MiB')\n\
        b = vramd.SharedBuffer.create('weights', 2 << 20)\n\
        b.lease()\n\
        p, v = b.begin_write()\n\
        ctypes.memset(p, 7, 2 << 20)\n\
        b.publish()\n\
        pin = b.pin()\n\
        mv = pin.view()\n\
        part = mv[(1 << 20):(1 << 20) + 8]\n\
        del mv\n\
        pin.release()\n\
        b.close()\n\
        print(bytes(part) == b'\\x07' * 8)\n\
        try:\n    pin.view()\n\
        except vramd.VramdError as e:\n    print(e)\n\
        try:\n    b.pin()\n\
        except vramd.VramdError as e:\n    print(e)\n\
        del part\n\
        gc.collect()\n\
        c = vramd.SharedBuffer.create('cache', 2 << 20)\n\
        c.lease()\n\
        c.begin_write()\n\
        print(c.publish() > 0, c.wait(than=1, timeout_s=0.12))\n\
        kept = c.pin()\n\
        data = bytes(kept.view())\n\
        c.close()\n\
        try:\n    kept.view()\n\
        except vramd.VramdError as e:\n    print(e)\n\
        t.close()\n\
        import time\n\
        for _ in range(100):\n    names = sorted(x['name'] for x in vramd.status()['tenants'])\n    \
        if not names: break\n    time.sleep(0.05)\n\
        print(names)\n";
    assert_eq!(
        python_lines(&d, script, &[]),
        [
            "True",
            "vramd: this pin was released",
            "vramd: shared buffer `weights` was closed",
            "True None",
            "vramd: this pin was released",
            "[]"
        ]
    );
}

/// A Ray task's tenant whose end meets a CUDA error (PyTorch's synchronize raises after a failed
/// kernel) is still ended, or marked left over so that its worker runs nothing after it; never
/// left connected with the next task refused under its name.
#[test]
fn a_task_tenant_is_ended_when_its_cuda_work_failed() {
    let d = Daemon::start(CONFIG);
    let script = "import vramd, vramd.ray as vr, vramd_torch, torch\n\
        def failed():\n    raise RuntimeError('CUDA error: device-side assert triggered')\n\
        torch.cuda.is_initialized = lambda: True\n\
        torch.cuda.synchronize = failed\n\
        vramd_torch.installed = lambda: 'full'\n\
        try:\n    with vr.task_tenant('t1'):\n        pass\n\
        except RuntimeError as e:\n    print('raised:', e)\n\
        print(vr._leftover, sorted(x['name'] for x in vramd.status()['tenants']))\n";
    assert_eq!(
        python_lines(&d, script, &[]),
        [
            "raised: CUDA error: device-side assert triggered",
            "None []"
        ]
    );
}

/// Full mode where its out-of-memory shim cannot be built (no C++ compiler): a clear error,
/// PyTorch's allocator left as it was; never vramd's raw allocator, whose refusal PyTorch would
/// turn into a tensor at address 0.
#[test]
fn full_mode_without_a_compiler_is_a_clear_error() {
    let d = Daemon::start(CONFIG);
    let cache = tempfile::tempdir().unwrap();
    // What the shim's build reads of PyTorch, stood in for; the allocator change recorded.
    let script = "import sys, types, torch, vramd_torch\n\
        torch.__version__ = '0+stand-in'\n\
        torch._C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=1)\n\
        ext = types.ModuleType('torch.utils.cpp_extension')\n\
        ext.include_paths = lambda: []\n\
        ext.library_paths = lambda: ['/nonexistent']\n\
        torch.utils = types.ModuleType('torch.utils')\n\
        torch.utils.cpp_extension = ext\n\
        sys.modules['torch.utils'] = torch.utils\n\
        sys.modules['torch.utils.cpp_extension'] = ext\n\
        changed = []\n\
        torch.cuda.memory.change_current_allocator = changed.append\n\
        torch.cuda.memory.CUDAPluggableAllocator = lambda *a: a\n\
        try:\n    vramd_torch.install(mode='full')\n    print('installed', changed)\n\
        except RuntimeError as e:\n    print('refused:', e)\n\
        print(vramd_torch.installed(), changed)\n";
    let env = [
        ("VRAMD_TORCH_CACHE", cache.path()),
        ("CXX", Path::new("/nonexistent/c++")),
    ];
    let lines = python_lines(&d, script, &env);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[0]
            .starts_with("refused: vramd: full mode is not available (cannot build the OOM shim")
            && lines[0].contains("/nonexistent/c++"),
        "{lines:?}"
    );
    assert_eq!(lines[1], "None []");
}

/// The lines `script` prints, run by python3 against `d` with the repository's packages and the
/// stand-in torch importable and libvram.so found through `VRAMD_LIB`; `env` added. The script
/// must succeed.
fn python_lines(d: &Daemon, script: &str, env: &[(&str, &Path)]) -> Vec<String> {
    let lib = library().expect("libvram.so builds");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = format!(
        "{}:{}",
        root.join("../../python").display(),
        root.join("tests/fake_torch").display()
    );
    let mut cmd = Command::new("python3");
    cmd.args(["-c", script])
        .env("PYTHONPATH", &python)
        .env("VRAMD_LIB", &lib)
        .env("VRAMD_SOCKET", &d.socket)
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    stdout.lines().map(str::to_owned).collect()
}
