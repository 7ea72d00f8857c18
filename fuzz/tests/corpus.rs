//! Replays every input of `corpus/<target>/` (and `crashes/<target>/`, inputs that once
//! failed, kept as regression cases) through its target's harness.

use std::path::Path;

#[test]
fn corpus_replays_cleanly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut total = 0;
    for (name, harness) in ferrovm_fuzz::TARGETS {
        for dir in ["corpus", "crashes"] {
            let Ok(entries) = std::fs::read_dir(root.join(dir).join(name)) else {
                continue;
            };
            for entry in entries {
                let path = entry.unwrap().path();
                let data = std::fs::read(&path).unwrap();
                harness(&data);
                total += 1;
            }
        }
    }
    assert!(
        total > 0,
        "no corpus under {}",
        root.join("corpus").display()
    );
    println!("replayed {total} inputs");
}
