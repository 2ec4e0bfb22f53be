//! The server's threads beside training: in a process of their own (a test binary holds one
//! test), since the check reads every `ember-dashboard` thread of the process.

use ember_dashboard::Options;

/// The scheduling policy and nice value of this process's `ember-dashboard` threads.
fn dashboard_threads() -> Vec<(u32, i64)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() != "ember-dashboard" {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // Fields after the parenthesised name: state is field 3; nice is 19, policy 41.
        let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
        out.push((fields[41 - 3].parse().unwrap(), fields[19 - 3].parse().unwrap()));
    }
    out
}

#[test]
fn beside_training_the_server_runs_on_idle_time_only() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("a")).unwrap();
    std::fs::write(dir.path().join("a/metrics.jsonl"), "{\"step\":1,\"train_loss\":3.0}\n").unwrap();
    let options = Options { idle_priority: true, ..Options::default() };
    let d = ember_dashboard::start(dir.path(), "127.0.0.1:0".parse().unwrap(), options).unwrap();
    // A request, so that the blocking threads that read runs exist too.
    let url = format!("http://127.0.0.1:{}/api/runs", d.addr().port());
    assert!(ureq::get(&url).call().unwrap().into_string().unwrap().contains("\"name\":\"a\""));
    let threads = dashboard_threads();
    assert!(threads.len() >= 3, "{threads:?}");
    // SCHED_IDLE is policy 5; the nice value is set first.
    assert!(threads.iter().all(|&(policy, nice)| policy == 5 && nice == 10), "{threads:?}");
}
