//! `uzswap run`: runs an unmodified program with a memory budget, through the preload
//! shim (crates/shim, `libuzswap_shim.so`).
//!
//! Settings come from, lowest priority first: a config file (`--config` or
//! `UZSWAP_CONFIG`, `key = value` lines), `UZSWAP_<KEY>` variables, the options below.
//! They are checked here, before the program starts (bad values: one line, exit 2), and
//! handed to the shim as `UZSWAP_<KEY>` variables, which an exec'd program inherits.
//!
//! The shim is `$UZSWAP_SHIM`, or `libuzswap_shim.so` next to this executable (what
//! `cargo build` of the workspace puts in target/<profile>/).
//!
//! After the program exits, the summary of every process that managed memory is
//! printed to stderr (unless `--stats none`); with `--stats FILE` the shim also leaves
//! one JSON object per process in FILE. The exit status is the program's (128+N when it
//! died of signal N). ^C and ^\ go to the program alone; SIGTERM and SIGHUP sent to
//! `uzswap run` are passed on to it.

use clap::{Arg, ArgMatches, FromArgMatches};
use std::ffi::OsString;
use std::io::{BufRead, Seek};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use uzswap_runtime::shim_support::{SettingDef, Settings, Writeback, SETTINGS};
use uzswap_runtime::RuntimeStats;

/// `uzswap run`'s arguments: an option per setting of the runtime's table
/// (`--folio-size` for `folio_size`, its help and default from the table), `--config`,
/// and the program. Built with clap's builder, so a new setting needs no edit here.
#[derive(Debug)]
pub struct RunArgs {
    /// The setting options given, as text (checked by `Settings::set`).
    options: Vec<(&'static SettingDef, String)>,
    config: Option<PathBuf>,
    command: Vec<OsString>,
}

impl clap::Args for RunArgs {
    fn augment_args(mut cmd: clap::Command) -> clap::Command {
        for def in SETTINGS {
            let help = match def.default_text() {
                Some(default) => format!("{} [default: {default}; e.g. {}]", def.help, def.example),
                None => format!("{} [e.g. {}]", def.help, def.example),
            };
            // No default_value: an absent option must not hide the config file and environment.
            let arg = Arg::new(def.name).long(def.option()).value_name(def.name.to_ascii_uppercase());
            cmd = cmd.arg(arg.help(help).allow_negative_numbers(true));
        }
        cmd.arg(
            Arg::new("config")
                .long("config")
                .value_name("FILE")
                .value_parser(clap::value_parser!(PathBuf))
                .help("A file of `key = value` lines with the same names (e.g. `budget = 1G`)."),
        )
        .arg(
            // Not allow_hyphen_values: an unknown option before the program is an error,
            // never taken for the program. After the program's name, every word is its.
            Arg::new("command")
                .value_name("COMMAND")
                .required(true)
                .num_args(1..)
                .trailing_var_arg(true)
                .value_parser(clap::value_parser!(OsString))
                .help("The program and its arguments."),
        )
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for RunArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(RunArgs {
            options: SETTINGS.iter().filter_map(|d| Some((d, m.get_one::<String>(d.name)?.clone()))).collect(),
            config: m.get_one::<PathBuf>("config").cloned(),
            command: m.get_many::<OsString>("command").into_iter().flatten().cloned().collect(),
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl RunArgs {
    /// Applies the setting options given (the highest layer).
    fn apply_options(&self, s: &mut Settings) -> Result<(), String> {
        for (def, value) in &self.options {
            s.set(def.name, value).map_err(|e| format!("--{}: {e}", def.option()))?;
        }
        Ok(())
    }
}

/// Config file, then environment, then options; validated, including what only trying
/// can tell (userfaultfd available, the writeback directory usable).
/// Also the userfaultfd access the program's processes will have.
fn settings(args: &RunArgs) -> Result<(Settings, uzswap_runtime::UffdAccess), String> {
    let mut s = Settings::default();
    let file = args.config.clone().or_else(|| std::env::var_os("UZSWAP_CONFIG").map(PathBuf::from));
    if let Some(f) = file {
        s.apply_config_file(&f)?;
    }
    s.apply_env_vars()?;
    args.apply_options(&mut s)?;
    s.validate()?;
    if s.writeback.is_some() {
        // One namespace for the run's remote objects, which every process of the tree
        // inherits (uzswap-remote), so that the end of the run can sweep what processes
        // killed before their exit left behind.
        let mut tag = [0u8; 6];
        // SAFETY: getrandom writes at most `tag.len()` bytes into `tag`.
        if unsafe { libc::getrandom(tag.as_mut_ptr().cast(), tag.len(), 0) } != tag.len() as isize {
            return Err(format!("getrandom: {}", std::io::Error::last_os_error()));
        }
        let tag: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        // Single-threaded still: nothing reads the environment meanwhile.
        std::env::set_var(uzswap_remote::NAMESPACE_VAR, &tag);
    }
    let mut probe = s.runtime_config();
    probe.publish_stats = false;
    if let Some(r) = &mut probe.remote {
        // Here, before the program starts: an unreachable store or a wrong password.
        r.lazy = false;
    }
    let access = uzswap_runtime::Runtime::new(probe).map_err(|e| format!("cannot start the runtime: {e}"))?.access();
    match s.writeback_path() {
        Some(dir) => {
            uzswap_backing::BackingFile::create(uzswap_backing::BackingConfig::new(&dir, s.writeback_max))
                .map_err(|e| format!("writeback directory {}: {e}", dir.display()))?;
        }
        None if s.writeback_dir == Writeback::Auto => eprintln!(
            "uzswap run: warning: no directory on a disk for the backing file ($XDG_RUNTIME_DIR, /var/tmp and /tmp are missing, full, read-only or in RAM): memory that does not compress will stay in the pool, over the budget (set --writeback-dir)"
        ),
        None => {}
    }
    Ok((s, access))
}

fn find_shim() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("UZSWAP_SHIM") {
        let p = PathBuf::from(p);
        return if p.is_file() { Ok(p) } else { Err(format!("UZSWAP_SHIM={}: no such file", p.display())) };
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find my own executable: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let p = dir.join("libuzswap_shim.so");
    if p.is_file() {
        return Ok(p);
    }
    Err(format!(
        "cannot find the shim: no {} (build the workspace with `cargo build`, or set UZSWAP_SHIM)",
        p.display()
    ))
}

pub fn run(args: RunArgs) -> ExitCode {
    let fail = |msg: String| {
        eprintln!("uzswap run: {msg}");
        ExitCode::from(2)
    };
    let (mut s, access) = match settings(&args) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let shim = match find_shim() {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    // Where the shim leaves its JSON lines: the user's file, or ours to print and remove.
    let (stats_file, ours) = match s.stats.as_str() {
        "none" => (None, false),
        "stderr" | "-" => (Some(std::env::temp_dir().join(format!("uzswap-run-{}.jsonl", std::process::id()))), true),
        path => (Some(PathBuf::from(path)), false),
    };
    let start_offset = stats_file.as_ref().and_then(|f| std::fs::metadata(f).ok()).map_or(0, |m| m.len());
    if let Some(f) = &stats_file {
        s.stats = f.display().to_string();
    }
    let mut preload = shim.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..]).env("LD_PRELOAD", preload).env_remove("UZSWAP_CONFIG").envs(s.to_env());
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        // The program's own limit, for exec'd programs of a process that lowered it.
        cmd.env(uzswap_runtime::fds::LIMIT_VAR, lim.rlim_cur.to_string());
    }
    // std's spawn empties the child's signal mask; the program gets ours, which is what
    // it would have inherited without uzswap (ignored dispositions pass through as is).
    // SAFETY: pthread_sigmask writes the sigset_t we own.
    let mut mask: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; a null new set only reads the current mask.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut mask) };
    // SAFETY: the closure runs in the forked child before exec and only calls
    // pthread_sigmask, which is async-signal-safe, with a copy of `mask`.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
            libc::pthread_sigmask(libc::SIG_SETMASK, &mask, std::ptr::null_mut());
            Ok(())
        })
    };
    // One budget for the whole tree, unless each process is to have its own.
    let group = if s.budget_per_process {
        None
    } else {
        match crate::group::Group::start(s.budget.unwrap_or(0), stats_file.clone()) {
            Ok(g) => Some(g),
            Err(e) => return fail(format!("cannot make the group's ledger: {e}")),
        }
    };
    if let Some(g) = &group {
        for (k, v) in g.env() {
            cmd.env(k, v);
        }
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("uzswap run: cannot run {}: {e}", args.command[0].to_string_lossy());
            return ExitCode::from(127);
        }
    };
    // The remote objects of processes of the tree that are gone go while the run goes
    // on (every 10 s), not only at its end.
    let remote = s.runtime_config().remote;
    if let Some(remote) = remote.clone() {
        let _ = std::thread::Builder::new().name("uzswap-sweep".into()).spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_secs(10));
            // Failures are said by the last sweep, at the end of the run.
            let _ = uzswap_remote::sweep(&remote, alive);
        });
    }
    // Like time(1): ^C goes to the program; we stay to report.
    // SAFETY: setting dispositions of our own process.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(libc::SIGQUIT, libc::SIG_IGN);
    }
    forward_termination(child.id());
    let status = if group.is_some() {
        wait_reaping(child.id())
    } else {
        use std::os::unix::process::ExitStatusExt;
        child.wait().map(|s| s.into_raw())
    };
    // Reaped: its pid is no longer ours to signal.
    PROGRAM.store(0, std::sync::atomic::Ordering::Relaxed);
    let status = match status {
        Ok(s) => s,
        Err(e) => return fail(format!("waiting for the program: {e}")),
    };
    let group_stats = group.map(|g| g.finish());
    if let Some(remote) = &remote {
        sweep_remote(remote);
    }
    if let Some(f) = &stats_file {
        print_summaries(f, start_offset, child.id(), access);
        if ours {
            let _ = std::fs::remove_file(f);
        }
        if let Some(g) = &group_stats {
            eprint!("{}", g.summary());
        }
    }
    let code = if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) };
    ExitCode::from(code.clamp(0, 255) as u8)
}

/// Whether process `pid` is alive (a sweep leaves its objects alone).
fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Deletes the remote objects of the run's processes that are gone (the runtime of a
/// process under the shim lives until the process does, and does not delete its own);
/// the live ones keep theirs.
fn sweep_remote(remote: &uzswap_remote::RemoteConfig) {
    let (target, ns) = (&remote.target, &remote.namespace);
    match uzswap_remote::sweep(remote, alive) {
        Ok(0) => {}
        Ok(n) => eprintln!("uzswap run: deleted what {n} exited processes left on {}", target.shown()),
        Err(e) => eprintln!(
            "uzswap run: warning: could not sweep {} for keys uzswap:{ns}:* left by exited processes (they expire on their own): {e}",
            target.shown()
        ),
    }
}

/// The program's pid, for [`forward`].
static PROGRAM: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let pid = PROGRAM.load(std::sync::atomic::Ordering::Relaxed);
    // SAFETY: the kernel's siginfo for this signal; getpgid and getpgrp are system calls.
    let (code, to_our_group) = unsafe {
        let from = (*info).si_pid();
        ((*info).si_code, from > 0 && libc::getpgid(from) == libc::getpgrp())
    };
    // Sent by the kernel (a terminal's hangup goes to the whole foreground group) or from
    // inside our process group (`kill 0` in a script): the program got it too.
    if pid > 0 && code == libc::SI_USER && !to_our_group {
        // SAFETY: kill is async-signal-safe; the program is our child, not yet reaped
        // (its pid is cleared right after it is).
        unsafe { libc::kill(pid, sig) };
    }
}

/// SIGTERM and SIGHUP sent to `uzswap run` alone (a service manager or `docker stop`
/// signalling its main process, `kill PID`) go on to the program, as a supervisor
/// (`timeout`, an init for containers) passes them: killed alone, `uzswap run` left the
/// program running on without its group's coordinator, its shares of the budget frozen
/// where they were. We stay to report, as for ^C. One sent to our whole process group
/// is not sent again.
fn forward_termination(pid: u32) {
    PROGRAM.store(pid as i32, std::sync::atomic::Ordering::Relaxed);
    for sig in [libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a handler of our own process that only reads its siginfo, makes two
        // system calls and kill; a signal we were started ignoring (nohup) stays
        // ignored, as for the program.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 || old.sa_sigaction == libc::SIG_IGN {
                continue;
            }
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = forward as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize;
            sa.sa_flags = libc::SA_RESTART | libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// Waits for the program (`pid`), reaping on the way the orphans of the tree that the
/// kernel hands to us as its subreaper (so that none is left a zombie). The program's
/// wait status.
fn wait_reaping(pid: u32) -> std::io::Result<i32> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes the int we own.
        let r = unsafe { libc::waitpid(-1, &mut status, 0) };
        if r == pid as i32 {
            return Ok(status);
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// The summary of each process that wrote a line to `file` after `offset`; and of the
/// program itself (`pid`) if it wrote none but left its live stats (a program that
/// exits without running exit handlers, as Go's runtime does).
fn print_summaries(file: &Path, offset: u64, pid: u32, access: uzswap_runtime::UffdAccess) {
    let mut any = false;
    let mut program_said = false;
    if let Ok(mut f) = std::fs::File::open(file) {
        let _ = f.seek(std::io::SeekFrom::Start(offset));
        for line in std::io::BufReader::new(f).lines().map_while(Result::ok) {
            match serde_json::from_str::<RuntimeStats>(&line) {
                Ok(st) => {
                    if let Some(c) = &st.command {
                        eprintln!("uzswap: {c}:");
                    }
                    eprint!("{}", st.summary());
                    any = true;
                    program_said |= st.pid == pid;
                }
                Err(e) => eprintln!("uzswap: unreadable stats line in {}: {e}", file.display()),
            }
        }
    }
    if !program_said {
        if let Ok(st) = uzswap_runtime::read_stats(pid) {
            eprintln!("uzswap: pid {pid} exited without running its exit handlers; its last live stats (at most a second old):");
            eprint!("{}", st.summary());
            let _ = std::fs::remove_file(uzswap_runtime::stats_path(pid));
            any = true;
        }
    }
    if !any {
        if access == uzswap_runtime::UffdAccess::UserModeOnly {
            // A program that ends without exit handlers (Go) may leave no line to say it.
            eprintln!("uzswap: no memory was managed: with UFFD_USER_MODE_ONLY only big malloc and mmap requests and a JVM's or Node's heap are, and a program that makes its system calls itself (Go) is left alone (see the README for a userfaultfd that serves system calls)");
        } else {
            eprintln!("uzswap: no memory was managed (nothing reached the threshold)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Args;

    fn parse(words: &[&str]) -> Result<RunArgs, clap::Error> {
        let cmd = RunArgs::augment_args(clap::Command::new("run").no_binary_name(true));
        RunArgs::from_arg_matches(&cmd.try_get_matches_from(words)?)
    }

    /// Each setting, set to its example, comes out the same from its option, its
    /// environment variable and a config line.
    #[test]
    fn every_setting_round_trips_through_option_environment_and_config() {
        for def in SETTINGS {
            let mut want = Settings::default();
            want.set(def.name, def.example).unwrap();
            assert_ne!(want, Settings::default(), "{}: the example is the default", def.name);

            let mut from_option = Settings::default();
            let opt = format!("--{}", def.option());
            parse(&[&opt, def.example, "--", "true"]).unwrap().apply_options(&mut from_option).unwrap();
            assert_eq!(from_option, want, "{opt}");

            let mut from_env = Settings::default();
            let var = def.env_var();
            from_env.apply_vars(|k| (k == var).then(|| def.example.into())).unwrap();
            assert_eq!(from_env, want, "{var}");

            let mut from_config = Settings::default();
            from_config.apply_config(&format!("{} = {}\n", def.name, def.example), "cfg").unwrap();
            assert_eq!(from_config, want, "config key {}", def.name);

            // What `uzswap run` hands the shim reads back the same.
            let mut handed = Settings::default();
            let env = want.to_env();
            handed.apply_vars(|k| env.iter().find(|(v, _)| v == k).map(|(_, x)| x.into())).unwrap();
            assert_eq!(handed, want, "{var} as handed to the shim");
        }
    }

    #[test]
    fn unknown_or_abbreviated_options_are_errors_not_the_program() {
        for bad in [&["--folio", "64K", "--", "true"][..], &["--folio", "64K", "true"], &["--bugdet", "1G", "true"]] {
            let err = parse(bad).unwrap_err();
            assert_eq!(err.kind(), clap::error::ErrorKind::UnknownArgument, "{bad:?}");
        }
        // After the program's name every word is the program's, dashes or not.
        let a = parse(&["--budget", "1G", "python3", "-c", "--budget"]).unwrap();
        assert_eq!(a.command, ["python3", "-c", "--budget"]);
        let a = parse(&["--level", "-3", "--", "--weird-name"]).unwrap();
        assert_eq!(a.command, ["--weird-name"]);
        assert_eq!(a.options[0].1, "-3");
    }
}
