//! The train_mlp example against the real daemon: its loss must fall below half of the first.

mod common;

#[path = "../examples/train_mlp.rs"]
#[allow(dead_code)]
mod train_mlp;

#[test]
fn train_mlp_loss_falls_below_half() {
    let d = common::Daemon::start(&[], false);
    let losses = train_mlp::train(&d.target(), 200, false).expect("training through the daemon");
    let (first, last) = (losses[0], *losses.last().unwrap());
    eprintln!("train_mlp: loss {first} -> {last} in {} steps", losses.len());
    assert!(first.is_finite() && last.is_finite());
    assert!(last < 0.5 * first, "loss {first} -> {last}: did not fall below half");
}
