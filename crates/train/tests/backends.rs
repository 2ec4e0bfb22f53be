//! The backend checks of `ember check`, on the CPU always and on WGPU with `--features wgpu`
//! (in CI: Mesa's lavapipe, a software Vulkan driver).

use ember_train::selfcheck::run;

fn assert_all_pass(checks: Vec<ember_train::selfcheck::Check>) {
    for c in &checks {
        eprintln!("{} {} ({}, {:.0} ms)", c.mark(), c.name, c.detail, c.ms);
    }
    let failed: Vec<&str> = checks.iter().filter(|c| !c.passed && !c.skipped).map(|c| c.name.as_str()).collect();
    assert!(failed.is_empty(), "failed: {failed:?}");
}

#[test]
fn cpu_passes_the_backend_checks() {
    assert_all_pass(run::<burn::backend::Autodiff<burn::backend::Flex>>(&Default::default(), 1e-4));
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_passes_the_backend_checks() {
    let device = burn::backend::wgpu::WgpuDevice::default();
    assert_all_pass(run::<burn::backend::Autodiff<burn::backend::Wgpu>>(&device, 1e-4));
}
