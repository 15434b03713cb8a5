fn main() -> std::process::ExitCode {
    match weft::cli::run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
