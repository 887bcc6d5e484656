pub fn placeholder() {}

pub mod bench;
