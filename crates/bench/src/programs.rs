//! `uzswap bench programs`: real programs nobody here wrote, each run plain, under the
//! kernel's zswap in a memory cgroup with a limit, and under `uzswap run` with its
//! default settings and the same budget, in one run on one machine.
//!
//! Programs: Python filling big buffers (examples/fill.py) and making millions of
//! small objects, Node filling arrays, Java and Go (dynamically linked: a static Go
//! binary never loads a preload) holding byte arrays, sqlite3 building an in-memory
//! table, redis-server (jemalloc) populated with keys, then once more with a
//! background save (a fork) after it, and xz -9 compressing realistic data (its match
//! finder reads and writes big tables at random: a working set near the whole
//! footprint, where what to evict matters most). Each checks its own result;
//! a program missing here is skipped with the reason.
//!
//! Per run: whether the output is right, wall time, the peak resident set of the
//! process tree, and for uzswap how much memory it managed (big requests served and
//! memory adopted in place) against the plain run's peak. The kernel side needs root
//! (memory cgroup, swap file, zswap); without it only plain and uzswap run.

use crate::kernel::machine::{self, Machine};
use crate::kernel::system::{self, Job, Outcome, RunError, System};
use crate::report::Report;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub struct ProgramsOpts {
    pub quick: bool,
    pub json: bool,
    /// Only these programs (names from the table); empty for all.
    pub programs: Vec<String>,
    /// The uzswap binary (default: this executable).
    pub uzswap: Option<PathBuf>,
}

/// One program at one scale: what to run, its budget, what its output must contain.
struct Program {
    name: &'static str,
    program: PathBuf,
    args: Vec<String>,
    budget: u64,
    expect: String,
}

#[derive(Serialize)]
struct Row {
    program: &'static str,
    system: String,
    budget_mib: u64,
    status: String,
    wall_s: Option<f64>,
    peak_rss_mib: Option<f64>,
    /// uzswap: bytes managed (big requests served, adopted in place) over the plain
    /// run's peak resident set.
    managed_pct: Option<f64>,
    /// kernel time / uzswap time (> 1: uzswap faster).
    speed_vs_kernel: Option<f64>,
    /// Peak RSS within budget x 1.15 + 32 MiB.
    rss_ok: Option<bool>,
}

const MIB: u64 = 1 << 20;

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(tool)).find(|p| p.is_file())
}

const OBJS_PY: &str = r#"import sys
n = int(sys.argv[1])
d = {i: (str(i) * 3, [i, i + 1]) for i in range(n)}
s = 0
for k in range(n):
    v = d[k]
    assert v[0] == str(k) * 3 and v[1][1] == k + 1
    s += v[1][0]
print("objects: ok", s)
"#;

const NODE_JS: &str = r#"const n = parseInt(process.argv[2]);
const bufs = [];
for (let i = 0; i < n; i++) { const a = new Array(16384); for (let j = 0; j < a.length; j++) a[j] = i * 7 + j; bufs.push(a); }
for (let p = 0; p < 2; p++) for (let i = 0; i < n; i++) { const a = bufs[i]; for (let j = 0; j < a.length; j += 16) if (a[j] !== i * 7 + j) { console.log("bad"); process.exit(1); } }
console.log("node: ok");
"#;

const HOLD_JAVA: &str = r#"public class Hold {
    public static void main(String[] a) {
        int mib = Integer.parseInt(a[0]);
        byte[][] bufs = new byte[mib][];
        for (int i = 0; i < mib; i++) {
            byte[] b = new byte[1 << 20];
            for (int j = 0; j < b.length; j += 64) b[j] = (byte) (i + j / 64);
            bufs[i] = b;
        }
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; i < mib; i++)
                for (int j = 0; j < bufs[i].length; j += 64)
                    if (bufs[i][j] != (byte) (i + j / 64)) { System.out.println("bad"); System.exit(1); }
        System.out.println("java: ok");
    }
}
"#;

const HOLD_GO: &str = include_str!("../../../examples/hold.go");

const REDIS_SH: &str = r#"port=$((20000 + $$ % 20000))
redis-server --port $port --save "" --appendonly no --enable-debug-command yes --dir "$2" >/dev/null &
srv=$!
i=0; until redis-cli -p $port ping >/dev/null 2>&1; do i=$((i+1)); [ $i -gt 600 ] && exit 2; sleep 0.05; done
redis-cli -p $port debug populate "$1" key 100 >/dev/null || exit 3
v=$(redis-cli -p $port get key:4242)
redis-cli -p $port shutdown nosave >/dev/null 2>&1
wait $srv
case "$v" in value:4242*) echo "redis: ok";; *) echo "redis: got $v"; exit 1;; esac
"#;

/// redis' background save (issue: a fork of a server whose data is mostly swapped out):
/// populated as above, then BGSAVE, and the dump checked by redis-check-rdb where it
/// is installed (every key read), else by the save's status.
const REDIS_BGSAVE_SH: &str = r#"port=$((20000 + $$ % 20000))
rm -f "$2/dump.rdb"
redis-server --port $port --save "" --appendonly no --enable-debug-command yes --dir "$2" >/dev/null &
srv=$!
i=0; until redis-cli -p $port ping >/dev/null 2>&1; do i=$((i+1)); [ $i -gt 600 ] && exit 2; sleep 0.05; done
redis-cli -p $port debug populate "$1" key 100 >/dev/null || exit 3
redis-cli -p $port bgsave >/dev/null || exit 4
until redis-cli -p $port info persistence | grep -q '^rdb_bgsave_in_progress:0'; do sleep 0.05; done
st=$(redis-cli -p $port info persistence | grep '^rdb_last_bgsave_status' | tr -d '\r')
redis-cli -p $port shutdown nosave >/dev/null 2>&1
wait $srv
[ "$st" = rdb_last_bgsave_status:ok ] || { echo "redis-bgsave: $st"; exit 1; }
if command -v redis-check-rdb >/dev/null; then
    redis-check-rdb "$2/dump.rdb" 2>&1 | grep -q "\] $1 keys read" || { echo "redis-bgsave: the dump does not hold $1 keys"; exit 1; }
fi
echo "redis-bgsave: ok"
"#;

/// xz -9 on one thread, then the result decompressed and compared with the input.
const XZ_SH: &str = r#"xz -9 -T1 -c "$1" > "$2" || exit 1
xz -dc "$2" | cmp -s - "$1" || { echo "xz: the round trip differs"; exit 1; }
echo "xz: ok"
"#;

/// How a program is made ready: its executable and arguments, or why it cannot run.
type Make<'a> = &'a mut dyn FnMut(&Path) -> Result<(PathBuf, Vec<String>), String>;

/// Writes the scripts and builds what needs building into `dir`, for the programs
/// `wanted` names only (a go build or javac for a run of xz alone took most of its
/// time); the programs that could be prepared, why the others could not, and the
/// names of all.
fn prepare(dir: &Path, quick: bool, wanted: &dyn Fn(&str) -> bool) -> (Vec<Program>, Vec<(&'static str, String)>, Vec<&'static str>) {
    let (mut ready, mut skipped, mut names) = (Vec::new(), Vec::new(), Vec::new());
    let scale = |q: u64, f: u64| if quick { q } else { f };
    let write = |name: &str, text: &str| -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write a bench script");
        p
    };
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let mut add = |name: &'static str, needs: &'static str, make: Make, budget: u64, expect: String| {
        names.push(name);
        if !wanted(name) {
            return;
        }
        match which(needs) {
            None => skipped.push((name, format!("{needs} is not installed"))),
            Some(tool) => match make(&tool) {
                Ok((program, args)) => ready.push(Program { name, program, args, budget, expect }),
                Err(e) => skipped.push((name, e)),
            },
        }
    };
    let fill = examples.join("fill.py");
    let n = scale(384, 1024);
    add("python-buffers", "python3", &mut |py| Ok((py.into(), vec![fill.display().to_string(), n.to_string(), "32".into(), "1".into()])), scale(128, 256) * MIB, "all bytes correct".into());
    let objs = write("objects.py", OBJS_PY);
    let n = scale(600_000, 3_000_000);
    add("python-objects", "python3", &mut |py| Ok((py.into(), vec![objs.display().to_string(), n.to_string()])), scale(128, 512) * MIB, "objects: ok".into());
    let js = write("hold.js", NODE_JS);
    let n = scale(2000, 6000);
    add("node", "node", &mut |node| Ok((node.into(), vec![js.display().to_string(), n.to_string()])), scale(128, 256) * MIB, "node: ok".into());
    let java = write("Hold.java", HOLD_JAVA);
    let n = scale(384, 1024);
    add(
        "java",
        "javac",
        &mut |javac| {
            let st = Command::new(javac).arg("-d").arg(dir).arg(&java).status().map_err(|e| format!("javac: {e}"))?;
            if !st.success() {
                return Err(format!("javac failed: {st}"));
            }
            let java = which("java").ok_or("java is not installed")?;
            Ok((java, vec!["-Xmx2g".into(), "-cp".into(), dir.display().to_string(), "Hold".into(), n.to_string()]))
        },
        scale(128, 512) * MIB,
        "java: ok".into(),
    );
    let n = scale(384, 1024);
    add(
        "go",
        "go",
        &mut |go| {
            let src = dir.join("gohold");
            std::fs::create_dir_all(&src).map_err(|e| e.to_string())?;
            std::fs::write(src.join("main.go"), HOLD_GO).map_err(|e| e.to_string())?;
            std::fs::write(src.join("go.mod"), "module gohold\ngo 1.22\n").map_err(|e| e.to_string())?;
            let out = dir.join("gohold-bin");
            // Linked dynamically (cgo): a static Go binary never loads a preload.
            let o = Command::new(go)
                .args(["build", "-ldflags=-linkmode=external", "-o"])
                .arg(&out)
                .arg(".")
                .current_dir(&src)
                .env("CGO_ENABLED", "1")
                .output()
                .map_err(|e| format!("go build: {e}"))?;
            if !o.status.success() {
                return Err(format!("go build failed: {}", String::from_utf8_lossy(&o.stderr).trim()));
            }
            Ok((out, vec![n.to_string()]))
        },
        scale(128, 256) * MIB,
        "go: ok".into(),
    );
    let rows = scale(300_000u64, 600_000);
    let sql = write(
        "table.sql",
        &format!(
            "CREATE TABLE t(a INTEGER, b TEXT);\nWITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {rows})\n\
             INSERT INTO t SELECT x, printf('%.200c', 'a') || x FROM c;\nSELECT 'sum', sum(a), count(*) FROM t;\n"
        ),
    );
    add("sqlite3", "sqlite3", &mut |sq| Ok((sq.into(), vec![":memory:".into(), format!(".read {}", sql.display())])), scale(64, 128) * MIB, format!("sum|{}|{rows}", rows * (rows + 1) / 2));
    let sh = write("redis.sh", REDIS_SH);
    let keys = scale(500_000, 2_000_000);
    let data = dir.join("redis-data");
    let _ = std::fs::create_dir_all(&data);
    add(
        "redis",
        "redis-server",
        &mut |_| Ok((PathBuf::from("/bin/sh"), vec![sh.display().to_string(), keys.to_string(), data.display().to_string()])),
        scale(64, 256) * MIB,
        "redis: ok".into(),
    );
    let sh = write("redis-bgsave.sh", REDIS_BGSAVE_SH);
    let data = dir.join("redis-bgsave-data");
    let _ = std::fs::create_dir_all(&data);
    add(
        "redis-bgsave",
        "redis-server",
        &mut |_| Ok((PathBuf::from("/bin/sh"), vec![sh.display().to_string(), keys.to_string(), data.display().to_string()])),
        scale(64, 256) * MIB,
        "redis-bgsave: ok".into(),
    );
    let sh = write("xz.sh", XZ_SH);
    let input = dir.join("xz-input");
    let mib = scale(8, 24) as usize;
    add(
        "xz",
        "xz",
        &mut |_| {
            std::fs::write(&input, uzswap_corpus::realistic(mib << 20, 42)).map_err(|e| format!("xz input: {e}"))?;
            Ok((PathBuf::from("/bin/sh"), vec![sh.display().to_string(), input.display().to_string(), dir.join("xz-output").display().to_string()]))
        },
        scale(96, 224) * MIB,
        "xz: ok".into(),
    );
    (ready, skipped, names)
}

fn job(p: &Program) -> Job<'_> {
    Job {
        program: &p.program,
        args: p.args.clone(),
        limit: p.budget,
        folio: 4096,
        // Real programs: uzswap with its default folio size, the kernel on its pages.
        folio_under_test: false,
        swap_bytes: 8 << 30,
        timeout: Duration::from_secs(600),
    }
}

/// Bytes uzswap managed in the run, from its stats file: the most any process had
/// (big requests at their peak plus memory adopted in place).
fn managed_bytes(stats: &Path) -> u64 {
    let text = std::fs::read_to_string(stats).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| {
            let adopted: u64 = v["adopted_bytes"].as_object().map_or(0, |m| m.values().filter_map(|b| b.as_u64()).sum());
            v["managed_peak_bytes"].as_u64().unwrap_or(0) + adopted
        })
        .max()
        .unwrap_or(0)
}

fn row(p: &Program, system: &str, o: Result<&Outcome, String>) -> Row {
    let mut r = Row {
        program: p.name,
        system: system.into(),
        budget_mib: p.budget / MIB,
        status: String::new(),
        wall_s: None,
        peak_rss_mib: None,
        managed_pct: None,
        speed_vs_kernel: None,
        rss_ok: None,
    };
    match o {
        Err(e) => r.status = e,
        Ok(o) => {
            r.status = match o.failure() {
                Some(f) => f,
                None if !o.stdout.contains(&p.expect) => format!("wrong output: {:?}", o.stdout.lines().last().unwrap_or("")),
                None => "ok".into(),
            };
            r.wall_s = Some((o.wall_secs * 100.0).round() / 100.0);
            r.peak_rss_mib = Some((o.peak_rss as f64 / MIB as f64 * 10.0).round() / 10.0);
            if system != "plain" {
                r.rss_ok = Some(o.peak_rss as f64 <= p.budget as f64 * 1.15 + 32.0 * MIB as f64);
            }
        }
    }
    r
}

pub fn run(opts: &ProgramsOpts) -> Result<Report, String> {
    let dir = tempfile::Builder::new().prefix("uzswap-bench-programs-").tempdir().map_err(|e| format!("temporary directory: {e}"))?;
    let wanted = |name: &str| opts.programs.is_empty() || opts.programs.iter().any(|p| p == name);
    let (programs, skipped, names) = prepare(dir.path(), opts.quick, &wanted);
    if let Some(p) = opts.programs.iter().find(|p| !names.contains(&p.as_str())) {
        return Err(format!("no program named {p:?}; the programs are {}", names.join(", ")));
    }
    let mut report = Report::new(opts.json);
    for (name, why) in &skipped {
        eprintln!("uzswap bench programs: SKIP {name}: {why}");
    }
    let uzswap = match &opts.uzswap {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| format!("current executable: {e}"))?,
    };
    let root = machine::is_root();
    if !root {
        eprintln!("uzswap bench programs: not root, so no kernel side (memory cgroup, swap file, zswap)");
    }
    let mut machine = if root { Some(Machine::new()?) } else { None };
    let mut swapfile: Option<PathBuf> = None;
    let kernel = System::Zswap("lzo".into());
    for p in &programs {
        let j = job(p);
        let mut plain = Command::new(&p.program);
        plain.args(&p.args);
        let plain = system::run_command(plain, &j).map_err(|e| format!("{e:?}"));
        let plain_rss = plain.as_ref().map_or(0, |o| o.peak_rss);
        report.row(&row(p, "plain", plain.as_ref().map_err(Clone::clone)));

        let mut kernel_secs = None;
        if let Some(m) = machine.as_mut() {
            if swapfile.is_none() {
                swapfile = Some(m.create_swapfile(if opts.quick { 2 << 30 } else { 8 << 30 })?);
            }
            let cg = format!("uzswap-programs-{}-{}", std::process::id(), p.name);
            let k = system::run_kernel(m, &kernel, &j, swapfile.as_deref(), &cg);
            if let Err(RunError::Teardown(e)) = &k {
                return Err(format!("could not put the machine back: {e}"));
            }
            let k = k.map_err(|e| format!("{e:?}"));
            let r = row(p, &kernel.name(), k.as_ref().map_err(Clone::clone));
            if r.status == "ok" {
                kernel_secs = r.wall_s;
            }
            report.row(&r);
        }

        let stats = dir.path().join(format!("{}.jsonl", p.name));
        let mut cmd = Command::new(&uzswap);
        cmd.args(["run", "--budget", &p.budget.to_string(), "--stats"]).arg(&stats).arg("--").arg(&p.program).args(&p.args);
        let u = system::run_command(cmd, &j).map_err(|e| format!("{e:?}"));
        let mut r = row(p, "uzswap", u.as_ref().map_err(Clone::clone));
        if plain_rss > 0 {
            r.managed_pct = Some((managed_bytes(&stats) as f64 / plain_rss as f64 * 1000.0).round() / 10.0);
        }
        if let (Some(k), Some(w), true) = (kernel_secs, r.wall_s, r.status == "ok") {
            r.speed_vs_kernel = Some((k / w.max(0.01) * 100.0).round() / 100.0);
        }
        report.row(&r);
    }
    drop(machine);
    Ok(report)
}
