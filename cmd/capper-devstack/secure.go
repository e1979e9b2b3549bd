package main

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/kafkaacl"
)

// secureFlags configure the secured brokers: TLS on the listener, SASL users
// with ACLs enforced, and a second broker that demands a client certificate.
type secureFlags struct {
	tlsCert, tlsKey string // the brokers' certificate; also the admin's client certificate on the mTLS broker
	saslUsers       string // file of "MECHANISM USER PASSWORD [superuser]" lines
	aclUser         string // the user granted capper's ACLs on the seeded topics
	mtlsPort        int    // 0: no mTLS broker
	clientCA        string // CA the mTLS broker verifies client certificates with
}

func (f *secureFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.tlsCert, "tls-cert", "", "certificate (PEM) of the brokers; enables TLS")
	fs.StringVar(&f.tlsKey, "tls-key", "", "key (PEM) of -tls-cert")
	fs.StringVar(&f.saslUsers, "sasl-users", "", "file of SASL users, one \"MECHANISM USER PASSWORD [superuser]\" per line; enables SASL and ACLs on the broker of -kafka-port")
	fs.StringVar(&f.aclUser, "acl-user", "", "the SASL user granted capper's ACLs on the seeded topics and the group "+config.DefaultGroupID)
	fs.IntVar(&f.mtlsPort, "mtls-port", 0, "port of a second broker that demands client certificates signed by -client-ca (needs -tls-cert)")
	fs.StringVar(&f.clientCA, "client-ca", "", "CA (PEM) of the client certificates -mtls-port accepts")
}

func (f *secureFlags) none() bool { return f.tlsCert == "" && f.saslUsers == "" && f.mtlsPort == 0 }

// broker is one kfake cluster to start: its options and those an admin
// client of it needs.
type broker struct {
	name  string
	port  int
	opts  []kfake.Opt
	admin []kgo.Opt
}

type saslUser struct {
	mechanism, name, password string
	super                     bool
}

func (f *secureFlags) brokers(port int) ([]broker, error) {
	main := broker{name: "plain", port: port}
	if f.none() {
		return []broker{main}, nil
	}
	if f.tlsCert == "" || f.tlsKey == "" {
		return nil, errors.New("the secured brokers need -tls-cert and -tls-key")
	}
	cert, err := tls.LoadX509KeyPair(f.tlsCert, f.tlsKey)
	if err != nil {
		return nil, fmt.Errorf("-tls-cert/-tls-key: %w", err)
	}
	roots := x509.NewCertPool()
	if leaf, err := x509.ParseCertificate(cert.Certificate[len(cert.Certificate)-1]); err == nil {
		roots.AddCert(leaf) // the admin trusts the broker's own chain: its CA is appended to the certificate file
	}
	main.name = "tls"
	main.opts = append(main.opts, kfake.TLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}))
	main.admin = append(main.admin, kgo.DialTLSConfig(&tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}))
	if f.saslUsers != "" {
		users, err := readUsers(f.saslUsers)
		if err != nil {
			return nil, err
		}
		main.name = "tls+sasl"
		main.opts = append(main.opts, kfake.EnableSASL(), kfake.EnableACLs())
		var admin *saslUser
		for i, u := range users {
			switch {
			case u.super:
				main.opts = append(main.opts, kfake.Superuser(u.mechanism, u.name, u.password))
				if admin == nil {
					admin = &users[i]
				}
			case u.name == f.aclUser:
				main.opts = append(main.opts, kfake.User(u.mechanism, u.name, u.password, capperACLs()...))
			default:
				main.opts = append(main.opts, kfake.User(u.mechanism, u.name, u.password))
			}
		}
		if admin == nil {
			return nil, fmt.Errorf("-sasl-users %s: no superuser line", f.saslUsers)
		}
		auth := scram.Auth{User: admin.name, Pass: admin.password}
		switch admin.mechanism {
		case "SCRAM-SHA-512":
			main.admin = append(main.admin, kgo.SASL(auth.AsSha512Mechanism()))
		case "SCRAM-SHA-256":
			main.admin = append(main.admin, kgo.SASL(auth.AsSha256Mechanism()))
		default:
			return nil, fmt.Errorf("-sasl-users: the superuser %s must use SCRAM-SHA-256 or SCRAM-SHA-512", admin.name)
		}
	}
	out := []broker{main}
	if f.mtlsPort != 0 {
		pem, err := os.ReadFile(f.clientCA)
		if err != nil {
			return nil, fmt.Errorf("-client-ca: %w", err)
		}
		cas := x509.NewCertPool()
		if !cas.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("-client-ca %s: no PEM certificate", f.clientCA)
		}
		out = append(out, broker{name: "mtls", port: f.mtlsPort,
			opts: []kfake.Opt{kfake.TLS(&tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: cas,
				ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12})},
			admin: []kgo.Opt{kgo.DialTLSConfig(&tls.Config{RootCAs: roots, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})},
		})
	}
	return out, nil
}

// capperACLs are the grants of the stack's worker on the default topics.
func capperACLs() []kfake.ACL {
	var acls []kfake.ACL
	for _, g := range kafkaacl.Grants(kafkaacl.NamesOf(config.DefaultGroupID, config.DefaultTopics, true)) {
		acls = append(acls, kfake.ACL{Resource: g.Resource, Name: g.Name, Pattern: g.Pattern, Operation: g.Operation, Allow: true})
	}
	return acls
}

func readUsers(path string) ([]saslUser, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("-sasl-users: %w", err)
	}
	defer f.Close()
	var users []saslUser
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		if len(fields) < 3 || len(fields) > 4 || len(fields) == 4 && fields[3] != "superuser" {
			return nil, fmt.Errorf("-sasl-users %s line %d: want MECHANISM USER PASSWORD [superuser]", path, n)
		}
		users = append(users, saslUser{mechanism: fields[0], name: fields[1], password: fields[2], super: len(fields) == 4})
	}
	return users, sc.Err()
}
