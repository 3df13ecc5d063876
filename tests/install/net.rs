//! Hosts of their own on one machine: a network namespace each, joined by a
//! bridge that the test's own namespace is on too (it reaches every host;
//! each host reaches the others). Made with iproute2, removed on drop.

use std::process::Command;

/// `n` hosts on a bridge, `10.77.<net>.1…n`; the test is `.254`.
pub struct Hosts {
    tag: String,
    net: u32,
    n: usize,
}

fn ip(args: &[&str]) {
    let o = Command::new("ip")
        .args(args)
        .output()
        .expect("ip (iproute2)");
    assert!(
        o.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
}

impl Hosts {
    /// Makes them; names carry this process's id, so runs side by side
    /// do not meet.
    pub fn new(n: usize) -> Hosts {
        let pid = std::process::id();
        let h = Hosts {
            tag: format!("{}", pid % 100_000),
            net: 20 + pid % 200,
            n,
        };
        h.remove();
        let br = h.bridge();
        ip(&["link", "add", &br, "type", "bridge"]);
        ip(&[
            "addr",
            "add",
            &format!("10.77.{}.254/24", h.net),
            "dev",
            &br,
        ]);
        ip(&["link", "set", &br, "up"]);
        for i in 0..n {
            let ns = h.ns(i);
            let veth = h.veth(i);
            ip(&["netns", "add", &ns]);
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ]);
            ip(&["link", "set", &veth, "master", &br]);
            ip(&["link", "set", &veth, "up"]);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", h.addr(i)),
                "dev",
                "eth0",
            ]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        h
    }

    fn bridge(&self) -> String {
        format!("lsb{}", self.tag)
    }

    fn veth(&self, i: usize) -> String {
        format!("lsv{}x{i}", self.tag)
    }

    /// Host `i`'s namespace.
    pub fn ns(&self, i: usize) -> String {
        format!("labsync-{}-{i}", self.tag)
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> String {
        format!("10.77.{}.{}", self.net, i + 1)
    }

    /// A command run on host `i`, in its network namespace only (`nsenter
    /// --net`): it sees the machine's /sys, cgroups included, as a server's
    /// labd does.
    pub fn exec(&self, i: usize) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.ns(i)));
        c
    }

    /// A command run on host `i` by `ip netns exec`, which mounts a sysfs of
    /// the namespace's own over /sys for it: the cgroup hierarchy is hidden,
    /// as in a container that does not share the host's.
    pub fn exec_hiding_cgroups(&self, i: usize) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(i)]);
        c
    }

    /// Cuts host `i` off the bridge.
    pub fn cut(&self, i: usize) {
        ip(&["link", "set", &self.veth(i), "down"]);
    }

    /// Joins it again.
    pub fn mend(&self, i: usize) {
        ip(&["link", "set", &self.veth(i), "up"]);
    }

    fn remove(&self) {
        for i in 0..self.n {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(i)])
                .output();
            let _ = Command::new("ip")
                .args(["link", "del", &self.veth(i)])
                .output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge()])
            .output();
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        self.remove();
    }
}
