//! `vramd top`: a live terminal view of devices and tenants. It polls the daemon's status over its
//! socket (as `vramd status` does; no HTTP) on a thread of its own, so that keys are answered
//! while a daemon that has stopped answering keeps a poll waiting, derives grant rates from
//! successive polls, and draws with ratatui. [`View`] holds the state and answers keys; [`draw`]
//! is a pure function of it, so both are tested without a terminal.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ratatui::crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, LineGauge, Paragraph, Row, Table};
use ratatui::Frame;
use vram_client::Observer;
use vram_core::Bytes;
use vram_proto::{StatusReport, TenantStatus};

use super::SocketArg;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Seconds between polls of the daemon.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
}

/// The longest `--interval`.
const MAX_INTERVAL: Duration = Duration::from_secs(86_400);

pub fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let socket = args.socket.path();
    let interval = Duration::try_from_secs_f64(args.interval)
        .ok()
        .filter(|d| !d.is_zero() && *d <= MAX_INTERVAL)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--interval must be a positive number of seconds, at most {} (a day)",
                MAX_INTERVAL.as_secs()
            )
        })?;
    // Fail on the plain terminal, before the screen is taken over.
    let observer = Observer::connect(Some(&socket))?;
    use std::io::IsTerminal;
    if !std::io::stdin().is_terminal() || !std::io::stdout().is_terminal() {
        anyhow::bail!(
            "vramd top draws on a terminal, and this process's input or output is not one: \
             `vramd status` (or `vramd status --json`) prints the same figures once"
        );
    }
    let mut terminal =
        ratatui::try_init().map_err(|e| anyhow::anyhow!("cannot take over the terminal: {e}"))?;
    let result = watch(&mut terminal, observer, &socket, interval);
    ratatui::restore();
    result.map(|()| std::process::ExitCode::SUCCESS)
}

/// How often the screen looks for keys and reports, and redraws when either came.
const TICK: Duration = Duration::from_millis(100);

/// A poll that has not answered after this long (and after two intervals) is shown as such.
const SLOW_ANSWER: Duration = Duration::from_secs(2);

fn watch(
    terminal: &mut ratatui::DefaultTerminal,
    observer: Observer,
    socket: &std::path::Path,
    interval: Duration,
) -> anyhow::Result<()> {
    let (tx, reports) = mpsc::channel();
    let socket = socket.to_path_buf();
    // Ends at its next send once this function has returned; at the process's exit if a poll
    // is still waiting for the daemon then.
    std::thread::Builder::new()
        .name("vramd-top-poll".into())
        .spawn(move || poll(observer, socket, interval, tx))?;
    let mut view = View::default();
    let mut last_answer = Instant::now();
    let mut redraw = true;
    loop {
        while let Ok(polled) = reports.try_recv() {
            last_answer = Instant::now();
            match polled {
                Ok(r) => view.update(r, last_answer),
                Err(e) => view.error = Some(e),
            }
            redraw = true;
        }
        let silent = last_answer.elapsed();
        if silent > SLOW_ANSWER.max(interval * 2) {
            let said = format!(
                "the daemon has not answered for {} s (the figures below are from then)",
                silent.as_secs()
            );
            if view.error.as_deref() != Some(said.as_str()) {
                view.error = Some(said);
                redraw = true;
            }
        }
        if redraw {
            terminal.draw(|f| draw(f, &view))?;
            redraw = false;
        }
        if event::poll(TICK)? {
            if let Event::Key(k) = event::read()? {
                if k.kind == KeyEventKind::Press && !view.key(k) {
                    return Ok(());
                }
                redraw = true;
            } else {
                // A resize, say.
                redraw = true;
            }
        }
    }
}

/// Polls the daemon every `interval` and sends each report, or why there is none, until the
/// screen is gone. A lost connection is made again at the next poll.
fn poll(
    observer: Observer,
    socket: PathBuf,
    interval: Duration,
    tx: mpsc::Sender<Result<StatusReport, String>>,
) {
    let mut observer = Some(observer);
    loop {
        let polled = match &observer {
            Some(o) => o.status(),
            None => Observer::connect(Some(&socket)).and_then(|o| {
                let s = o.status();
                observer = Some(o);
                s
            }),
        };
        let sent = match polled {
            Ok(r) => tx.send(Ok(r)),
            Err(e) => {
                observer = None;
                tx.send(Err(format!("{e} (retrying)")))
            }
        };
        if sent.is_err() {
            return;
        }
        std::thread::sleep(interval);
    }
}

/// The tenant table's columns, in order; each is a sort key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    Tenant,
    Gpu,
    Class,
    Held,
    InUse,
    Cached,
    Guarantee,
    Limit,
    Rate,
    Refused,
}

const COLUMNS: [Column; 10] = [
    Column::Tenant,
    Column::Gpu,
    Column::Class,
    Column::Held,
    Column::InUse,
    Column::Cached,
    Column::Guarantee,
    Column::Limit,
    Column::Rate,
    Column::Refused,
];

impl Column {
    fn title(self) -> &'static str {
        match self {
            Column::Tenant => "TENANT",
            Column::Gpu => "GPU",
            Column::Class => "CLASS",
            Column::Held => "HELD",
            Column::InUse => "IN USE",
            Column::Cached => "CACHED",
            Column::Guarantee => "GUARANTEE",
            Column::Limit => "LIMIT",
            Column::Rate => "GRANTS/S",
            Column::Refused => "REFUSED",
        }
    }

    fn width(self) -> u16 {
        match self {
            Column::Tenant => 18,
            Column::Gpu => 4,
            Column::Class => 8,
            Column::Rate => 9,
            Column::Refused => 8,
            _ => 10,
        }
    }

    /// Names sort A to Z first; figures largest first.
    fn descending_first(self) -> bool {
        !matches!(self, Column::Tenant | Column::Gpu | Column::Class)
    }
}

/// What `top` shows: the last report, grant rates from the last two polls, and the sort order.
#[derive(Debug)]
pub struct View {
    report: Option<StatusReport>,
    /// Grants per second by tenant id, from the last two polls.
    rates: HashMap<u64, f64>,
    last: Option<(Instant, HashMap<u64, u64>)>,
    sort: Column,
    descending: bool,
    error: Option<String>,
}

impl Default for View {
    fn default() -> Self {
        View {
            report: None,
            rates: HashMap::new(),
            last: None,
            sort: Column::Held,
            descending: true,
            error: None,
        }
    }
}

impl View {
    pub fn update(&mut self, report: StatusReport, at: Instant) {
        let grants: HashMap<u64, u64> = report.tenants.iter().map(|t| (t.id, t.grants)).collect();
        if let Some((then, before)) = &self.last {
            let secs = at.duration_since(*then).as_secs_f64();
            self.rates = grants
                .iter()
                .filter(|_| secs > 0.0)
                .filter_map(|(id, n)| Some((*id, n.saturating_sub(*before.get(id)?) as f64 / secs)))
                .collect();
        }
        self.last = Some((at, grants));
        self.report = Some(report);
        self.error = None;
    }

    /// Answers a key; `false` means quit.
    pub fn key(&mut self, k: KeyEvent) -> bool {
        let at = COLUMNS.iter().position(|c| *c == self.sort).unwrap_or(0);
        match k.code {
            KeyCode::Char('q') | KeyCode::Esc => return false,
            KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => return false,
            KeyCode::Char('s') | KeyCode::Right | KeyCode::Tab => {
                self.sort_by(COLUMNS[(at + 1) % COLUMNS.len()])
            }
            KeyCode::Char('S') | KeyCode::Left | KeyCode::BackTab => {
                self.sort_by(COLUMNS[(at + COLUMNS.len() - 1) % COLUMNS.len()])
            }
            KeyCode::Char('r') => self.descending = !self.descending,
            KeyCode::Char(d @ '0'..='9') => {
                let i = (d as usize - '0' as usize + 9) % 10;
                self.sort_by(COLUMNS[i]);
            }
            _ => {}
        }
        true
    }

    fn sort_by(&mut self, c: Column) {
        self.sort = c;
        self.descending = c.descending_first();
    }

    fn rate(&self, t: &TenantStatus) -> Option<f64> {
        self.rates.get(&t.id).copied()
    }

    /// The tenants in display order.
    fn sorted(&self) -> Vec<&TenantStatus> {
        let Some(r) = &self.report else {
            return Vec::new();
        };
        let mut rows: Vec<&TenantStatus> = r.tenants.iter().collect();
        let key = |t: &TenantStatus| -> u64 {
            match self.sort {
                Column::Gpu => t.gpu as u64,
                Column::Held => t.held.get(),
                Column::InUse => t.in_use.get(),
                Column::Cached => t.cached.get(),
                Column::Guarantee => t.guarantee.get(),
                Column::Limit => t.limit.get(),
                Column::Rate => (self.rate(t).unwrap_or(0.0) * 1000.0) as u64,
                Column::Refused => t.refusals.values().sum(),
                Column::Tenant | Column::Class => 0,
            }
        };
        rows.sort_by(|a, b| {
            let by = match self.sort {
                Column::Tenant => a.name.cmp(&b.name),
                Column::Class => a.class.cmp(&b.class),
                _ => key(a).cmp(&key(b)),
            };
            let by = if self.descending { by.reverse() } else { by };
            by.then_with(|| a.name.cmp(&b.name)).then(a.id.cmp(&b.id))
        });
        rows
    }
}

/// Width of the per-tenant bar, in cells.
const BAR: usize = 24;

pub fn draw(f: &mut Frame, view: &View) {
    let devices = view.report.as_ref().map_or(0, |r| r.devices.len()) as u16;
    let [head, dev_area, table_area, foot] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(devices + 2),
        Constraint::Min(3),
        Constraint::Length(1),
    ])
    .areas(f.area());
    f.render_widget(Paragraph::new(header(view)), head);
    draw_devices(f, view, dev_area);
    draw_tenants(f, view, table_area);
    let keys = "s/→ next column  S/← previous  1-9,0 pick  r reverse  q quit   \
                █ in use  ▒ cached  ░ held, unreported  ┆ guarantee";
    f.render_widget(
        Paragraph::new(keys).style(Style::new().add_modifier(Modifier::DIM)),
        foot,
    );
}

fn header(view: &View) -> Line<'static> {
    let mut spans = Vec::new();
    if let Some(r) = &view.report {
        let d = &r.daemon;
        let rate = view.rates.values().fold(0.0, |a, r| a + r);
        spans.push(Span::styled(
            format!("vramd {} pid {}", d.version, d.pid),
            Style::new().add_modifier(Modifier::BOLD),
        ));
        spans.push(Span::raw(format!(
            "  up {:.0} s  {} tenant(s)  {} connection(s)  {:.1} grants/s  {} protocol error(s)",
            d.uptime_seconds,
            r.tenants.len(),
            d.connections,
            rate,
            d.protocol_errors
        )));
    } else {
        spans.push(Span::raw("vramd: waiting for the first status"));
    }
    if let Some(e) = &view.error {
        spans.push(Span::styled(format!("  {e}"), Style::new().fg(Color::Red)));
    }
    Line::from(spans)
}

fn draw_devices(f: &mut Frame, view: &View, area: Rect) {
    let block = Block::bordered().title(" devices: held of capacity ");
    let inner = block.inner(area);
    f.render_widget(block, area);
    let Some(r) = &view.report else { return };
    for (i, d) in r.devices.iter().enumerate() {
        let row = Rect {
            y: inner.y + i as u16,
            height: 1,
            ..inner
        };
        if row.y >= inner.bottom() {
            break;
        }
        let mut label = format!(
            "GPU {} {} {:<12} held {} of {}, pooled {}, reserved {}, free {} ",
            d.index,
            d.backend,
            &d.uuid[..d.uuid.len().min(12)],
            d.held,
            d.capacity,
            d.pooled,
            d.reserved,
            d.free
        );
        if d.outside_use > vram_core::Bytes::ZERO {
            label.push_str(&format!("outside {} ", d.outside_use));
        }
        if d.deficit > vram_core::Bytes::ZERO {
            label.push_str(&format!("GUARANTEES AT RISK by {} ", d.deficit));
        }
        let gauge = LineGauge::default()
            .label(label)
            .ratio(ratio(d.held, d.capacity))
            .filled_style(Style::new().fg(Color::Green))
            .unfilled_style(Style::new().fg(Color::DarkGray));
        f.render_widget(gauge, row);
    }
}

fn ratio(part: Bytes, whole: Bytes) -> f64 {
    if whole == Bytes::ZERO {
        0.0
    } else {
        (part.get() as f64 / whole.get() as f64).clamp(0.0, 1.0)
    }
}

fn draw_tenants(f: &mut Frame, view: &View, area: Rect) {
    let arrow = if view.descending { "▼" } else { "▲" };
    let mut titles: Vec<Cell> = COLUMNS
        .iter()
        .map(|c| {
            if *c == view.sort {
                Cell::from(format!("{}{arrow}", c.title()))
                    .style(Style::new().add_modifier(Modifier::REVERSED))
            } else {
                Cell::from(c.title())
            }
        })
        .collect();
    titles.insert(4, Cell::from("HELD OF LIMIT"));
    let rows = view.sorted().into_iter().map(|t| {
        let refused: u64 = t.refusals.values().sum();
        let refused_style = if refused > 0 {
            Style::new().fg(Color::Red)
        } else {
            Style::new()
        };
        Row::new(vec![
            Cell::from(t.name.clone()),
            Cell::from(t.gpu.to_string()),
            Cell::from(t.class.clone()),
            Cell::from(t.held.to_string()),
            Cell::from(bar(t)),
            Cell::from(t.in_use.to_string()),
            Cell::from(t.cached.to_string()),
            Cell::from(t.guarantee.to_string()),
            Cell::from(t.limit.to_string()),
            Cell::from(view.rate(t).map_or("-".into(), |r| format!("{r:.1}"))),
            Cell::from(refused.to_string()).style(refused_style),
        ])
    });
    let mut widths: Vec<Constraint> = COLUMNS
        .iter()
        .map(|c| Constraint::Length(c.width()))
        .collect();
    widths.insert(4, Constraint::Length(BAR as u16));
    let table = Table::new(rows, widths)
        .header(Row::new(titles).style(Style::new().add_modifier(Modifier::BOLD)))
        .block(Block::bordered().title(" tenants "));
    f.render_widget(table, area);
}

/// Held memory against the limit: in use, cached, held but not reported, and where the
/// guarantee ends.
fn bar(t: &TenantStatus) -> Line<'static> {
    let limit = t.limit.get().max(t.held.get()).max(1) as f64;
    let cell = |bytes: Bytes| ((bytes.get() as f64 / limit) * BAR as f64).round() as usize;
    let in_use = cell(t.in_use).min(BAR);
    let cached = cell(t.in_use + t.cached).min(BAR) - in_use;
    let held = cell(t.held).min(BAR).saturating_sub(in_use + cached);
    let rest = BAR - in_use - cached - held;
    let guarantee = (t.guarantee > Bytes::ZERO).then(|| cell(t.guarantee).min(BAR - 1));
    let mut empty: Vec<char> = vec!['·'; rest];
    if let Some(g) = guarantee {
        if let Some(i) = g.checked_sub(in_use + cached + held) {
            if i < rest {
                empty[i] = '┆';
            }
        }
    }
    Line::from(vec![
        Span::styled("█".repeat(in_use), Style::new().fg(Color::Green)),
        Span::styled("▒".repeat(cached), Style::new().fg(Color::Yellow)),
        Span::styled("░".repeat(held), Style::new().fg(Color::Blue)),
        Span::styled(
            empty.into_iter().collect::<String>(),
            Style::new().fg(Color::DarkGray),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;
    use vram_proto::{DaemonInfo, DeviceStatus};

    use super::*;

    fn tenant(id: u64, name: &str, held: u64, grants: u64) -> TenantStatus {
        TenantStatus {
            id,
            name: name.into(),
            gpu: 0,
            class: "normal".into(),
            priority: 50,
            guarantee: Bytes::gib(1),
            limit: Bytes::gib(8),
            held: Bytes::gib(held),
            charged: Bytes::ZERO,
            outside: Bytes::ZERO,
            kept: Bytes::ZERO,
            in_use: Bytes::gib(held / 2),
            cached: Bytes::gib(held / 4),
            handles: held,
            pid: 100 + id as u32,
            uid: 0,
            grants,
            returns: 0,
            refusals: [("over_limit".to_string(), id)].into(),
        }
    }

    fn report(tenants: Vec<TenantStatus>) -> StatusReport {
        StatusReport {
            daemon: DaemonInfo {
                pid: 42,
                version: "0.1.0".into(),
                uptime_seconds: 3.0,
                socket: "/tmp/s".into(),
                protocol_errors: 0,
                connections: tenants.len() as u64,
                log_lines_dropped: 0,
                connections_refused: 0,
                tenants_left_out: 0,
            },
            devices: vec![DeviceStatus {
                index: 0,
                uuid: "host-0".into(),
                name: "host".into(),
                backend: vram_proto::BackendKind::Host,
                capacity: Bytes::gib(16),
                granularity: Bytes::mib(2),
                held: Bytes::gib(6),
                pooled: Bytes::mib(8),
                reserved: Bytes::ZERO,
                free: Bytes::gib(10),
                device_used: Bytes::gib(6),
                pool: Default::default(),
                driver_used: None,
                outside_use: Bytes::ZERO,
                unattributed: Bytes::ZERO,
                outside_processes: Vec::new(),
                deficit: Bytes::ZERO,
                at_risk: Vec::new(),
                kept: Bytes::ZERO,
                kept_offline: Vec::new(),
            }],
            tenants,
            shared: Default::default(),
        }
    }

    fn screen(view: &View) -> String {
        let mut term = Terminal::new(TestBackend::new(150, 16)).unwrap();
        term.draw(|f| draw(f, view)).unwrap();
        let buf = term.backend().buffer().clone();
        (0..buf.area.height)
            .map(|y| {
                (0..buf.area.width)
                    .map(|x| buf[(x, y)].symbol())
                    .collect::<String>()
                    + "\n"
            })
            .collect()
    }

    fn press(view: &mut View, c: KeyCode) -> bool {
        view.key(KeyEvent::new(c, KeyModifiers::NONE))
    }

    #[test]
    fn rates_come_from_successive_polls_and_keys_sort() {
        let mut v = View::default();
        let t0 = Instant::now();
        v.update(
            report(vec![tenant(1, "alpha", 2, 10), tenant(2, "beta", 4, 0)]),
            t0,
        );
        assert!(v.rates.is_empty());
        v.update(
            report(vec![tenant(1, "alpha", 2, 30), tenant(2, "beta", 4, 5)]),
            t0 + Duration::from_secs(2),
        );
        assert_eq!(v.rates[&1], 10.0);
        assert_eq!(v.rates[&2], 2.5);
        let names = |v: &View| {
            v.sorted()
                .iter()
                .map(|t| t.name.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&v), ["beta", "alpha"], "held, largest first");
        assert!(press(&mut v, KeyCode::Char('r')));
        assert_eq!(names(&v), ["alpha", "beta"]);
        press(&mut v, KeyCode::Char('9'));
        assert_eq!(v.sort, Column::Rate);
        assert_eq!(names(&v), ["alpha", "beta"], "alpha grants faster");
        press(&mut v, KeyCode::Char('s'));
        assert_eq!(v.sort, Column::Refused);
        press(&mut v, KeyCode::Char('s'));
        assert_eq!(v.sort, Column::Tenant);
        press(&mut v, KeyCode::Left);
        assert_eq!(v.sort, Column::Refused);
        assert!(!press(&mut v, KeyCode::Char('q')));
    }

    #[test]
    fn the_screen_shows_devices_tenants_and_bars() {
        let mut v = View::default();
        v.update(report(vec![tenant(1, "alpha", 4, 1)]), Instant::now());
        let s = screen(&v);
        assert!(s.contains("held 6 GiB of 16 GiB"), "{s}");
        assert!(s.contains("alpha"), "{s}");
        assert!(s.contains("HELD▼"), "{s}");
        // 4 GiB held of an 8 GiB limit: 2 in use, 1 cached, 1 not reported.
        assert!(s.contains("██████▒▒▒░░░············"), "{s}");
    }

    #[test]
    fn the_bar_marks_the_guarantee_beyond_what_is_held() {
        let mut t = tenant(1, "a", 0, 0);
        t.guarantee = Bytes::gib(4);
        let text: String = bar(&t)
            .spans
            .iter()
            .map(|s| s.content.to_string())
            .collect();
        assert_eq!(text.chars().count(), BAR);
        assert_eq!(text.chars().nth(12), Some('┆'), "{text}");
    }
}
